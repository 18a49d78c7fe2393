"""The V4.1 organism drafts with DSpark: a three-stage drafter trained on the frozen shipped V4.1 organism, in V4.1's
layout (issue #55).

``python -m dsv4convert.organism.dspark_v41 --out DIR --seconds S [--device cuda] [--seed N] [--steps N] [--tiny]``
trains it and writes ``DIR/organism-v41-dspark/``: ``dspark.safetensors`` (every ``mtp.*`` tensor the V4.1 release
stores, in its dtypes: ``models/deepseek_v41/inventory.py::stage_inventory``, FP8 E4M3 in 32 x 32 blocks with E8M0
scales, MXFP4 experts, BF16 norms and Markov/confidence heads, F32 hyper-connections, sinks and router biases) and
``dspark.json`` (the ``text_config`` keys it sets, then the provenance: command, commit, device, steps, seconds, the
curve, and the acceptance per draft position measured on the assembled checkpoint read back from disk). What
``dsv4convert/data/organism-v41-dspark/`` ships and ``synth --preset organism-v41 --drafter dspark`` puts under
``mtp.*`` (:func:`~dsv4convert.organism.export.write_v41_with_drafter`).

The backbone is the shipped V4.1 organism as released (``dsv4convert/data/organism-v41``, every weight dequantized,
frozen: :func:`load_target`), run by :class:`~dsv4convert.model.v41.forward.V41Model`; the drafter learns from the
features it computes (:func:`~dsv4convert.model.v41.dspark.features_of` on the forward's ``captured``: each target
layer's stream mean after its Engram and before its attention) and is :class:`~dsv4convert.model.v41.dspark.V41Drafter`,
which drafts as SGLang 0.5.23 does. Its shape (:func:`dspark_v41_config`) is the release's in miniature, as
``organism/dspark.py`` makes V4's: three stages drafting from the organism's last three layers (3, 4, 5 of 6: the
release drafts from 37-39 of 40), blocks of 5, a Markov head of rank 64 (a quarter of the hidden size), ``<think>``
as the noise token (the organism's data never contain it), and the stages' own MoE: 4 experts, 2 per token (the
release's drafter has a third of its backbone's experts and half its top-k, 128 and 3 of 384 and 6; the organism's
backbone has 8 and 2, and one expert per token would leave the router no gradient, its one weight renormalized to 1).

Objective, loop and measurements are ``organism/dspark.py``'s (:func:`~dsv4convert.organism.dspark.train_on_target`),
on the V4.1 organism's own data: needle prompts of 56 to 1,024 tokens and its language with the n-gram facts.
Deterministic for a seed on a CPU (``tests/test_organism_v41_dspark.py``). The Markov head's ``markov_w2`` trains in
float32 (BF16 master weights would lose Adam's small steps) and is stored BF16, as SGLang holds it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from dsv4convert import __version__
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.devices import resolve_device
from dsv4convert.errors import DSV4Error
from dsv4convert.model.v41.dspark import V41Drafter, features_of
from dsv4convert.model.v41.forward import V41Model, load_block
from dsv4convert.model.v41.weights import WeightSource, load
from dsv4convert.models.deepseek_v4.configs import drafter_keys as v4_drafter_keys
from dsv4convert.models.deepseek_v4.layout import TensorSpec
from dsv4convert.models.deepseek_v41.config import V41Config, read_config
from dsv4convert.models.deepseek_v41.inventory import stage_inventory
from dsv4convert.models.deepseek_v41.tokenizer import compressed_token_map
from dsv4convert.organism.cli import TINY_DRAFTER, TINY_MEASURE
from dsv4convert.organism.dspark import (
    BLOCK_SIZE,
    MARKOV_RANK,
    NOISE_TOKEN,
    STAGES,
    DraftResult,
    DraftSettings,
    MeasureSettings,
    describe_acceptance,
    measure,
    train_on_target,
)
from dsv4convert.organism.export import (
    DSPARK_PROVENANCE_NAME,
    DSPARK_TENSORS_NAME,
    write_drafter_files,
    write_v41_with_drafter,
)
from dsv4convert.organism.language import documents_with_facts
from dsv4convert.organism.provenance import source_commit
from dsv4convert.organism.v41 import HELDOUT_NAME, PROVENANCE_NAME, stored_group
from dsv4convert.synth import ORGANISM_V41_DIR

CHECKPOINT_DIR = "organism-v41-dspark"   # under --out: what dsv4convert/data/organism-v41-dspark/ ships
EXPERTS, EXPERTS_PER_TOKEN = 4, 2
LANGUAGE_DOCS = 3000                      # the V4.1 organism's (V41Settings.language_docs)
BUDGET = 180.0
# The V4.1 organism's data (V41Settings): needles and language rows of 56 to 1,024 tokens, 60 % needles.
V41_DATA = {"min_length": 56, "max_length": 1024, "needle_fraction": 0.6}
TINY = {**TINY_DRAFTER, "min_length": 56, "needle_fraction": 0.6, "warmup_steps": 1}
TINY_LANGUAGE_DOCS = 24


def dspark_v41_config(base_config: dict, tokenizer: Tokenizer) -> dict:
    """The V4.1 organism's config.json with its DSpark drafter: the release's ``text_config`` keys
    (``num_nextn_predict_layers`` the stage count, a 0 compress ratio per stage, ``dspark_*``), checked by
    :func:`~dsv4convert.models.deepseek_v41.config.read_config`."""
    noise = tokenizer.token_to_id(NOISE_TOKEN)
    if noise is None:
        raise DSV4Error(f"the organism's tokenizer has no {NOISE_TOKEN} token")
    config = copy.deepcopy(base_config)
    text = config["text_config"]
    n = int(text["num_hidden_layers"])
    if text.get("dspark_target_layer_ids") is not None:
        raise DSV4Error("the V4.1 organism's config already has a DSpark drafter")
    text.update(num_nextn_predict_layers=STAGES, compress_ratios=list(text["compress_ratios"][:n]) + [0] * STAGES,
                dspark_block_size=BLOCK_SIZE, dspark_noise_token_id=int(noise),
                dspark_target_layer_ids=list(range(n - STAGES, n)), dspark_markov_rank=MARKOV_RANK,
                dspark_n_routed_experts=EXPERTS, dspark_num_experts_per_tok=EXPERTS_PER_TOKEN)
    read_config(config, "the V4.1 organism's config with its DSpark drafter")
    return config


def drafter_keys(config: dict) -> dict:
    """The keys a DSpark drafter sets on the V4.1 organism's config: V4's (``configs.drafter_keys``), nested in
    ``text_config`` as the release's are."""
    return {"text_config": v4_drafter_keys(config["text_config"])}


# -- the target -------------------------------------------------------------------------------------------------


def load_target(path: Path, device: torch.device) -> V41Model:
    """A V4.1 checkpoint's text model resident, every weight dequantized to float32 on ``device`` as
    :class:`~dsv4convert.model.v41.forward.V41Runner` reads it (Engram tables whole), frozen, in eval mode."""
    ckpt = Checkpoint.open(path)
    source = WeightSource(ckpt, device, torch.float32)
    tokenizer = Path(path) / "tokenizer.json"
    if not tokenizer.is_file():
        raise DSV4Error("no tokenizer.json: the Engram hash needs its compressed token map", file=tokenizer)
    model = V41Model(source.cfg, compressed_token_map(Tokenizer.from_file(str(tokenizer)))[0])
    model.layers = nn.ModuleList(load_block(source, i, fp8_table=False) for i in range(source.cfg.num_hidden_layers))
    load(model, source, {name: name for name in ("embed.weight", "norm.weight", "head.weight")})
    return model.to(device).eval().requires_grad_(False)


class V41Target:
    """The frozen V4.1 organism as the drafter trainer reads it (``organism/dspark.py::DraftTarget``)."""

    def __init__(self, model: V41Model, cfg: V41Config):
        """``cfg``: the drafter's config (its target layers; the shipped backbone's own config has none)."""
        self.model = model.eval().requires_grad_(False)
        self.layers = tuple(cfg.dspark.target_layer_ids)
        self.embed, self.lm_head = model.embed.weight, model.head.weight

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(ids, capture=self.layers)
        return features_of(out.captured, self.layers), out.logits

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, capture=()).logits


# -- the drafter ------------------------------------------------------------------------------------------------


def new_drafter(cfg: V41Config, initializer_range: float) -> V41Drafter:
    """A fresh drafter: every linear and embedding ``N(0, initializer_range)`` as the V4.1 organism's were (the
    hyper-connections, sinks and norms as V4.1's modules make them), the Markov bias and the confidence at zero (it
    drafts from its base logits alone and is unsure, as ``DSparkDrafter.init_weights``); ``markov_w2`` float32."""
    drafter = V41Drafter(cfg)
    for module in drafter.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=initializer_range)
    head = drafter.head
    head.markov_head.markov_w2.weight = nn.Parameter(torch.zeros_like(head.markov_head.markov_w2.weight,
                                                                      dtype=torch.float32))
    nn.init.zeros_(head.confidence_head.proj.weight)
    return drafter


def native_state(drafter: V41Drafter) -> dict[str, torch.Tensor]:
    """Every ``mtp.*`` tensor under its release name, float32 on the CPU: what :func:`write_drafter` stores."""
    params = dict(drafter.named_parameters())
    return {native: params[path].detach().to("cpu", torch.float32) for native, path in drafter.native_paths().items()}


def drafter_groups(cfg: V41Config) -> list[list[TensorSpec]]:
    """The release's ``mtp.S`` groups, in order (the stages' part of ``inventory.native_groups``)."""
    return [stage_inventory(cfg, s) for s in range(cfg.dspark.stages)]


def write_drafter(dst: Path, drafter: V41Drafter, config: dict, provenance: dict, *, overwrite: bool = False) -> Path:
    """``dspark.safetensors`` (every ``mtp.*`` tensor stored as the release stores it, quantized by the V4.1
    organism's :func:`~dsv4convert.organism.v41.stored_group`) and ``dspark.json`` (:func:`drafter_keys`, then
    ``provenance``)."""
    cfg, state = drafter.cfg, native_state(drafter)
    groups = drafter_groups(cfg)
    tensors = (item for group in groups for item in stored_group(state, group, cfg))
    return write_drafter_files(dst, tensors, [s for group in groups for s in group], drafter_keys(config), provenance,
                               overwrite=overwrite)


def load_assembled(path: Path, device: torch.device) -> tuple[V41Target, V41Drafter]:
    """An assembled checkpoint (backbone and drafter, V4.1's layout) read back: the target and the drafter, every
    weight dequantized from disk (the drafter by :meth:`V41Drafter.from_source`, as ``compare`` reads it)."""
    source = WeightSource(Checkpoint.open(path), device, torch.float32)
    if source.cfg.dspark is None:
        raise DSV4Error("not a V4.1 checkpoint with a DSpark drafter", file=path)
    return V41Target(load_target(path, device), source.cfg), V41Drafter.from_source(source).to(device)


# -- training ---------------------------------------------------------------------------------------------------


def train(config: dict, tokenizer: Tokenizer, text: str, settings: DraftSettings, *, device: torch.device,
          language_docs: int = LANGUAGE_DOCS, log=print) -> DraftResult:
    """Train the drafter of ``config`` (:func:`dspark_v41_config`) on the frozen shipped V4.1 organism; ``text`` is
    held-out text (the curve's acceptance is measured on it)."""
    cfg = read_config(config, "the V4.1 drafter's config")
    target = V41Target(load_target(ORGANISM_V41_DIR, device), cfg)
    return train_on_target(target, lambda: new_drafter(cfg, settings.initializer_range), tokenizer, text, settings,
                           bos_id=cfg.math.bos_token_id, device=device,
                           docs=documents_with_facts(settings.seed + 1, language_docs), log=log)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4convert.organism.dspark_v41",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path,
                   help=f"output directory: {CHECKPOINT_DIR}/ ({DSPARK_TENSORS_NAME}, {DSPARK_PROVENANCE_NAME}), what "
                        f"dsv4convert/data/{CHECKPOINT_DIR}/ ships")
    p.add_argument("--seconds", type=float, default=BUDGET,
                   help=f"training time budget: the step count is chosen after the first steps to fill it (default "
                        f"{BUDGET:.0f}); training stops at 1.1 x this + 15 s whatever the count")
    p.add_argument("--steps", type=int, help="replay a run's recorded step count instead of --seconds")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true",
                   help="a few steps on short rows: the pipeline on a CPU, not a drafter")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        raise DSV4Error(f"--steps must be at least 1, got {args.steps}")
    device = resolve_device(args.device)
    settings = DraftSettings(**{**V41_DATA, **(TINY if args.tiny else {}), "time_budget": args.seconds,
                                "time_limit": args.seconds * 1.1 + 15, "seed": args.seed,
                                **({"steps": args.steps} if args.steps else {})})
    measured_on = MeasureSettings(seed=args.seed, **(TINY_MEASURE if args.tiny else {}))
    tokenizer = Tokenizer.from_file(str(ORGANISM_V41_DIR / "tokenizer.json"))
    config = dspark_v41_config(json.loads((ORGANISM_V41_DIR / "config.json").read_text()), tokenizer)
    text = (ORGANISM_V41_DIR / HELDOUT_NAME).read_text(encoding="utf-8")
    started = time.perf_counter()
    print(f"training the V4.1 organism's DSpark drafter on {device} for {args.seconds:.0f} s (seed {args.seed})",
          flush=True)
    result = train(config, tokenizer, text, settings, device=device,
                   language_docs=TINY_LANGUAGE_DOCS if args.tiny else LANGUAGE_DOCS,
                   log=lambda line: print(line, flush=True))
    provenance = {
        "what": "the DSpark drafter of the V4.1 organism, trained on the frozen shipped organism "
                "(dsv4convert/organism/dspark_v41.py, docs/organism.md)",
        "command": "python -m dsv4convert.organism.dspark_v41 " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": source_commit(), "dsv4convert": __version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "seed": args.seed,
        "base": {"organism": "dsv4convert/data/organism-v41",
                 "commit": json.loads((ORGANISM_V41_DIR / PROVENANCE_NAME).read_text()).get("commit", "unknown")},
        "steps": result.steps_run, "training_seconds": round(result.seconds, 1),
        "hit_time_limit": result.hit_time_limit, "parameters": sum(p.numel() for p in result.drafter.parameters()),
        "settings": dataclasses.asdict(result.settings), "curve": result.curve,
    }
    with tempfile.TemporaryDirectory(prefix="organism-v41-drafter-") as tmp:
        drafter_dir = write_drafter(Path(tmp) / "drafter", result.drafter, config, provenance)
        assembled = write_v41_with_drafter(Path(tmp) / "organism", ORGANISM_V41_DIR, drafter_dir)
        target, drafter = load_assembled(assembled, device)
        acceptance = measure(drafter, target, tokenizer, text, measured_on)
    provenance.update(measured_on=dataclasses.asdict(measured_on), acceptance=acceptance,
                      total_seconds=round(time.perf_counter() - started, 1))
    dst = write_drafter(Path(args.out) / CHECKPOINT_DIR, result.drafter, config, provenance, overwrite=True)
    size = (dst / DSPARK_TENSORS_NAME).stat().st_size
    print(f"wrote {dst} ({size / 1e6:.2f} MB of drafter tensors; {result.steps_run} steps, {result.seconds:.0f} s of "
          "training); acceptance per draft position, read back as synth --preset organism-v41 --drafter dspark "
          "writes it:", flush=True)
    for line in describe_acceptance(acceptance):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
