"""One SGLang server's settings as an object, and the ``sglang.launch_server`` command line it renders.

:func:`server` makes the settings ``serve`` launches for a variant on a GPU family (:mod:`.rules`);
``serve`` renders them (:meth:`Server.argv`, :meth:`Server.environment`), and ``fit``, ``compare``,
``automix`` and the model card read the fields: nothing parses a command line back. A user's own
``launch_server`` arguments (``serve ... -- ARGS``) are read once, at the edge
(:meth:`Server.with_arguments`): the flags sizing and numerics depend on become fields, the rest is
passed through as given. CI parses every rendered command with SGLang's own parser
(tests/test_serve_launch.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

from dsv4convert.engines import NO_DRAFT, SGLANG_LABEL, EngineError, gpu_family_major
from dsv4convert.engines.sglang.quant_config import v41_family_problem, v41_serving_env
from dsv4convert.engines.sglang.rules import (
    EAGLE_DRAFT_TOKENS,
    EAGLE_STEPS,
    EAGLE_TOPK,
    SM120_DECODE_GRAPH_BS,
    SM120_MEM_FRACTION,
    SPECULATIVE_ALGORITHM,
    VariantRules,
    variant_rules,
)
from dsv4convert.models.deepseek_v4.layout import Drafter, ModelConfig

ROLES = ("prefill", "decode", "server")
DRAFT_LABELS = {Drafter.MTP: "MTP", Drafter.DSPARK: "DSpark", Drafter.NONE: "no"}

# DeepSeek-V4.1's Engram tables: where a server keeps them, and the environment that puts them there
# (srt/environ.py; layers/engram.py::EngramEmbedding.__init__ and _init_host_table). ``gpu``: SGLang's default,
# each TP rank's row shard in GPU memory; ``host-shared``: SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE with the
# layout's default ``shared``, one memfd buffer of every row per TP group, mapped by each rank (ranks in one PID
# namespace, no lookup all-reduce); ``host-per-rank``: layout ``per_rank``, each rank's process holds its own rows.
ENGRAM_ENV: dict[str, dict[str, str]] = {
    "gpu": {},
    "host-shared": {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1", "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "shared"},
    "host-per-rank": {"SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE": "1",
                      "SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT": "per_rank"},
}


@dataclass(frozen=True)
class Disaggregation:
    """How a PD server moves KV caches (``--disaggregation-*``)."""

    transfer_backend: str = "mooncake_tcp"
    bootstrap_port: int = 8998
    ib_devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Server:
    """One SGLang server: what it loads, where, and every setting the tool decides or reads."""

    model: str
    variant: str                       # the variant whose rules apply (variants.served_like; V4.1: v41_variant_of)
    gpu_family: str
    role: str = "server"               # prefill, decode, or server (no disaggregation)
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int = 29100
    kv_cache_dtype: str = "fp8_e4m3"
    moe_runner_backend: str | None = None       # None: SGLang chooses
    fp8_gemm_backend: str | None = None         # None: SGLang chooses (auto)
    mem_fraction_static: float | None = None    # None: SGLang's default (memory_hook.py)
    cuda_graph_max_bs_decode: int | None = None
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    mtp: bool = False                           # serve the checkpoint's drafter (EAGLE or DSPARK, by ``drafter``)
    drafter: Drafter = Drafter.MTP              # what the checkpoint's mtp.* holds (config.json)
    dspark_block_size: int | None = None        # DSPARK's gamma: the config's dspark_block_size unless overridden
    speculative_num_steps: int | None = None           # None: the preset (EAGLE's balanced one; DSPARK's 1)
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    draft_moe_runner_backend: str | None = None
    fp4_indexer: bool = False                   # --enable-deepseek-v4-fp4-indexer
    indexer_topk: bool = False                  # return the indexer's top-k (one attention-DP rank per GPU)
    enable_metrics: bool = False
    disaggregation: Disaggregation | None = None   # set for prefill and decode
    pp_size: int = 1                            # --pp-size (V4.1 refuses > 1)
    two_batch_overlap: bool = False             # --enable-two-batch-overlap (V4.1 refuses it)
    hisparse: bool = False                      # --enable-hisparse (V4.1 refuses it)
    engram: str | None = None                   # DeepSeek-V4.1: where its Engram tables live (ENGRAM_ENV); None: V4
    env: dict[str, str] = field(default_factory=dict)          # what the variant needs (rules.VariantRules.env)
    passthrough: tuple[str, ...] = ()           # the user's other launch_server arguments, rendered last

    @property
    def major(self) -> int:
        return gpu_family_major(self.gpu_family)

    @property
    def speculative_algorithm(self) -> str | None:
        """EAGLE for the preview's MTP block, DSPARK for a bundled DSpark drafter, None when no draft is served."""
        return SPECULATIVE_ALGORITHM[self.drafter] if self.mtp else None

    @property
    def draft_tokens(self) -> int | None:
        """Tokens verified per step with the draft (None: no draft). DSPARK verifies its whole block and the
        anchor, gamma + 1 (``arg_groups/speculative_hook.py::_handle_dspark``)."""
        if not self.mtp:
            return None
        if self.drafter is Drafter.DSPARK:
            return self.dspark_block_size + 1
        return self.speculative_num_draft_tokens or EAGLE_DRAFT_TOKENS

    @property
    def is_v41(self) -> bool:
        return self.engram is not None

    def environment(self) -> dict[str, str]:
        """The variables the server starts with: the variant's, and V4.1's Engram placement."""
        return {**self.env, **ENGRAM_ENV.get(self.engram or "gpu", {})}

    @property
    def rules(self) -> VariantRules:
        return variant_rules(self.variant, self.gpu_family, self.drafter)

    def argv(self) -> list[str]:
        """The arguments of ``python -m sglang.launch_server`` (what SGLang's parser sees)."""
        args = ["--model-path", self.model, "--host", self.host, "--port", str(self.port), "--tp-size", str(self.tp),
                "--nccl-port", str(self.nccl_port), "--kv-cache-dtype", self.kv_cache_dtype]
        if self.moe_runner_backend:
            args += ["--moe-runner-backend", self.moe_runner_backend]
        if self.fp8_gemm_backend:
            args += ["--fp8-gemm-backend", self.fp8_gemm_backend]
        if self.mem_fraction_static is not None:
            args += ["--mem-fraction-static", _decimal(self.mem_fraction_static)]
        if self.cuda_graph_max_bs_decode is not None:
            args += ["--cuda-graph-max-bs-decode", str(self.cuda_graph_max_bs_decode)]
        if self.max_running_requests is not None:
            args += ["--max-running-requests", str(self.max_running_requests)]
        if self.chunked_prefill_size is not None:
            args += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.speculative_algorithm == "DSPARK":
            # The draft path defaults to --model-path (the drafter is bundled); steps and top-k are forced to 1
            # and the draft-token count to gamma + 1. The block size is written out so the command says it.
            args += ["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size",
                     str(self.dspark_block_size)]
        elif self.speculative_algorithm == "EAGLE":
            args += ["--speculative-algorithm", "EAGLE",
                     "--speculative-num-steps", str(self.speculative_num_steps or EAGLE_STEPS),
                     "--speculative-eagle-topk", str(self.speculative_eagle_topk or EAGLE_TOPK),
                     "--speculative-num-draft-tokens", str(self.draft_tokens)]
        if self.mtp and self.draft_moe_runner_backend:
            args += ["--speculative-moe-runner-backend", self.draft_moe_runner_backend]
        if self.fp4_indexer:
            args += ["--enable-deepseek-v4-fp4-indexer"]
        if self.indexer_topk:
            # The capturer needs attention TP == 1, i.e. one attention-DP rank per GPU; DSPARK under attention
            # DP needs the LM head split the same way (speculative_hook.py::_handle_dspark).
            args += ["--enable-return-indexer-topk", "--attn-dp-size", str(self.tp)]
            if self.speculative_algorithm == "DSPARK" and self.tp > 1:
                args += ["--enable-dp-lm-head"]
        if self.enable_metrics:
            args += ["--enable-metrics"]
        if self.pp_size != 1:
            args += ["--pp-size", str(self.pp_size)]
        if self.two_batch_overlap:
            args += ["--enable-two-batch-overlap"]
        if self.hisparse:
            args += ["--enable-hisparse"]
        if self.disaggregation is not None:
            d = self.disaggregation
            args += ["--disaggregation-mode", self.role, "--disaggregation-transfer-backend", d.transfer_backend,
                     "--disaggregation-bootstrap-port", str(d.bootstrap_port)]
            if d.transfer_backend == "mooncake" and d.ib_devices:
                args += ["--disaggregation-ib-device", ",".join(d.ib_devices)]
        return args + list(self.passthrough)

    def command(self, python: str) -> list[str]:
        """The whole command: ``python -m sglang.launch_server`` and :meth:`argv`."""
        return [python, "-m", "sglang.launch_server", *self.argv()]

    def with_arguments(self, arguments: tuple[str, ...] | list[str]) -> Server:
        """These settings with a user's own ``launch_server`` arguments: the flags the tool reads become fields
        (the user's value wins), the rest pass through unchanged, in order."""
        known, rest = _USER_FLAGS.parse_known_args(list(arguments))
        if rest and rest[0] == "--":
            rest = rest[1:]
        changes = {name: value for name, value in vars(known).items() if value is not None}
        if any(name.startswith(("speculative_", "dspark_")) for name in changes):   # the user's own draft settings
            changes["mtp"] = True
        chosen = changes.pop("speculative_algorithm", None)
        served = replace(self, **changes, passthrough=self.passthrough + tuple(rest))
        if served.is_v41:
            served.check_v41(chosen)
        if served.mtp:
            served._check_draft(chosen)
        return served

    def check_v41(self, chosen: str | None = None) -> None:
        """What SGLang refuses for DeepSeek-V4.1, named before launch
        (``arg_groups/deepseek_v4_hook.py::validate_deepseek_v41_features``, run by ``model_hook.py`` for
        ``DeepseekV4ForCausalLM`` with ``model_type`` deepseek_v41). Its unified KV layout is HIP-only
        (``layers/attention/dsv4/unified_kv_gate.py::is_unified_kv_triton``), never on these GPU families. Its DSpark
        draft under PD wants Mooncake or NIXL, which every ``--transfer-backend`` serve offers is
        (``pd_disaggregation_hook.py::handle_pd_disaggregation`` rewrites mooncake_tcp to mooncake first)."""
        refused = (("--pp-size", self.pp_size > 1, "pipeline parallelism"),
                   ("--enable-two-batch-overlap", self.two_batch_overlap, "two-batch overlap"),
                   ("--enable-hisparse", self.hisparse, "HiSparse"))
        for flag, given, feature in refused:
            if given:
                raise EngineError(f"{flag}: {SGLANG_LABEL} refuses {feature} for DeepSeek-V4.1 "
                                  "(arg_groups/deepseek_v4_hook.py::validate_deepseek_v41_features)")
        if chosen is not None and chosen.upper() != "DSPARK":
            raise EngineError(f"--speculative-algorithm {chosen}: DSPARK is DeepSeek-V4.1's only speculative algorithm "
                              f"in {SGLANG_LABEL} (arg_groups/deepseek_v4_hook.py::validate_deepseek_v41_features)")

    def _check_draft(self, chosen: str | None) -> None:
        """Refuse draft settings SGLang would refuse or, worse, accept and load wrong."""
        if self.drafter is Drafter.NONE:
            raise EngineError(f"--speculative-* arguments: {NO_DRAFT}")
        expected = SPECULATIVE_ALGORITHM[self.drafter]
        if chosen is not None and chosen != expected:
            why = ("SGLang would build its one-layer NextN draft and load the DSpark stages into it, silently "
                   "leaving e_proj/h_proj/enorm/hnorm uninitialized (configs/model_config.py::"
                   "_config_draft_model)" if self.drafter is Drafter.DSPARK else
                   "V4 takes EAGLE or DSPARK (arg_groups/deepseek_v4_hook.py), and DSPARK needs a bundled "
                   "DSpark drafter, which this checkpoint's config does not announce")
            raise EngineError(f"--speculative-algorithm {chosen}: this checkpoint's {DRAFT_LABELS[self.drafter]} draft "
                              f"is served by {expected}; {why}")
        if self.drafter is not Drafter.DSPARK:
            return
        if self.dspark_block_size is None or self.dspark_block_size < 1:
            raise EngineError(f"--speculative-dspark-block-size: DSPARK needs a positive block size, got "
                              f"{self.dspark_block_size}")
        tokens = self.speculative_num_draft_tokens
        if tokens is not None and tokens != self.dspark_block_size + 1:
            raise EngineError(f"--speculative-num-draft-tokens {tokens}: DSPARK verifies its block and the anchor, "
                              f"{self.dspark_block_size + 1} tokens for block size {self.dspark_block_size} (SGLang "
                              "refuses any other count; set --speculative-dspark-block-size instead)")
        for flag, value in (("--speculative-num-steps", self.speculative_num_steps),
                            ("--speculative-eagle-topk", self.speculative_eagle_topk)):
            if value not in (None, 1):
                raise EngineError(f"{flag} {value}: DSPARK drafts its whole block in one step with one candidate "
                                  "(SGLang overrides it to 1)")


def _decimal(value: float) -> str:
    """A fraction as the cookbook writes it (0.70), or in full where two decimals would round it."""
    text = f"{value:.2f}"
    return text if float(text) == value else repr(value)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:   # argparse would exit; one error line instead
        raise EngineError(f"launch_server arguments: {message}")


# The launch_server flags whose values the tool's sizing and numerics read (SGLang's own names).
_USER_FLAGS = _Parser(add_help=False, allow_abbrev=False)
for _flag, _type in (("--kv-cache-dtype", str), ("--moe-runner-backend", str), ("--fp8-gemm-backend", str),
                     ("--mem-fraction-static", float), ("--cuda-graph-max-bs-decode", int),
                     ("--max-running-requests", int), ("--chunked-prefill-size", int),
                     ("--speculative-algorithm", str), ("--speculative-num-steps", int),
                     ("--speculative-eagle-topk", int), ("--speculative-num-draft-tokens", int),
                     ("--speculative-moe-runner-backend", str), ("--speculative-dspark-block-size", int)):
    _USER_FLAGS.add_argument(_flag, type=_type, default=None,
                             dest=_flag[2:].replace("-", "_").replace("speculative_moe", "draft_moe")
                             .replace("speculative_dspark", "dspark"))
_USER_FLAGS.add_argument("--enable-deepseek-v4-fp4-indexer", dest="fp4_indexer", action="store_const", const=True,
                         default=None)
_USER_FLAGS.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=None)
for _flag, _dest in (("--enable-two-batch-overlap", "two_batch_overlap"), ("--enable-hisparse", "hisparse")):
    _USER_FLAGS.add_argument(_flag, dest=_dest, action="store_const", const=True, default=None)


def drafter_of(config: ModelConfig | None) -> dict[str, object]:
    """The :class:`Server` fields that follow from what a checkpoint's config says its ``mtp.*`` holds."""
    if config is None:
        return {}
    return {"drafter": config.drafter, "dspark_block_size": config.dspark.block_size if config.dspark else None}


def server(model: str, variant: str, gpu_family: str, *, role: str = "server", tp: int = 1, mtp: bool = False,
           drafter: Drafter = Drafter.MTP, **settings) -> Server:
    """The server ``serve`` launches for ``variant`` on ``gpu_family``: the variant's MoE runner and environment,
    the cookbook's SM120 memory settings, the checkpoint's draft (``drafter``: EAGLE for the preview's MTP
    block, DSPARK for 0731's drafter) where its MoE method runs there (else refused), and for a prefill or
    decode role the PD transfer settings (``serve`` gives its own)."""
    if role not in ROLES:
        raise EngineError(f"not a server role: {role!r}")
    rules = variant_rules(variant, gpu_family, drafter)
    if mtp and drafter is Drafter.NONE:
        raise EngineError(f"no draft to serve: {NO_DRAFT}")
    if mtp and not rules.serves_draft:
        raise EngineError(f"no {DRAFT_LABELS[drafter]} draft for the {variant} variant on {gpu_family}: "
                          f"{rules.mtp_note}")
    sm120 = gpu_family_major(gpu_family) == 12
    base = Server(model=model, variant=variant, gpu_family=gpu_family, role=role, tp=tp, mtp=mtp, drafter=drafter,
                  moe_runner_backend=rules.moe_runner_backend,
                  mem_fraction_static=SM120_MEM_FRACTION if sm120 else None,
                  cuda_graph_max_bs_decode=SM120_DECODE_GRAPH_BS if sm120 and role in ("decode", "server") else None,
                  draft_moe_runner_backend=rules.draft_moe_runner_backend if mtp else None, env=dict(rules.env),
                  disaggregation=Disaggregation() if role in ("prefill", "decode") else None)
    served = replace(base, **settings)
    if mtp:
        served._check_draft(None)
    return served


def server_v41(model: str, gpu_family: str, *, variant: str = "native", role: str = "server", tp: int = 1,
               engram: str = "gpu", mtp: bool = False, drafter: Drafter = Drafter.NONE, **settings) -> Server:
    """The server ``serve`` launches for a DeepSeek-V4.1 ``variant`` (the release or what ``convert`` writes:
    ``engines/config.py::v41_variant_of``) and ``fit`` sizes: SGLang's own defaults for it on every family, the
    variant's environment (:func:`~dsv4convert.engines.sglang.quant_config.v41_serving_env`), the Engram tables where
    ``engram`` says, and the DSpark drafter (its only speculative algorithm) when ``mtp``. A variant SGLang has no
    kernel for on ``gpu_family`` is refused (``v41_family_problem``: ModelOpt's NVFP4 hybrid off sm_100). Nothing
    per family is set here: for ``DeepseekV4ForCausalLM`` with ``model_type`` deepseek_v41 SGLang
    picks the attention backend (``deepseek_v4_hook.py::_default_dsv4_attention_backend``: FlashMLA's mega kernels
    on sm_100), the MoE runner (``model_overrides/deepseek_v4.py``: ``flashinfer_mxfp4`` for FP4 experts on
    sm_90/sm_100/sm_120), the MXFP8 dense GEMMs on sm_100 (``flashinfer_cutedsl``, same file), leaves the sliding
    window pool to the request cap (no ``swa_full_tokens_ratio``), and sets sm_120's environment itself
    (``model_hook.py``: FP8 wo_a GEMM and top-k v2 off, TileLang MHC-pre off, fused MHC post/pre on, DeepGEMM
    HC-prenorm off, torch paged-MQA logits and the TileLang indexer on). V4's cookbook settings for sm_120
    (``--mem-fraction-static 0.70``, Marlin experts) are V4's, not applied."""
    if role not in ROLES:
        raise EngineError(f"not a server role: {role!r}")
    if engram not in ENGRAM_ENV:
        raise EngineError(f"Engram placement {engram!r}: expected one of {', '.join(ENGRAM_ENV)}")
    if mtp and drafter is not Drafter.DSPARK:
        raise EngineError(f"no draft to serve: DeepSeek-V4.1 drafts with a DSpark drafter only, and this checkpoint's "
                          f"config announces {'none' if drafter is Drafter.NONE else DRAFT_LABELS[drafter]}")
    problem = v41_family_problem(variant, gpu_family)
    if problem:
        raise EngineError(f"{SGLANG_LABEL} does not run this DeepSeek-V4.1 {variant} checkpoint on {gpu_family}: "
                          f"{problem}")
    served = replace(Server(model=model, variant=variant, gpu_family=gpu_family, role=role, tp=tp, mtp=mtp,
                            drafter=drafter, engram=engram, env=v41_serving_env(variant),
                            disaggregation=Disaggregation() if role in ("prefill", "decode") else None), **settings)
    served.check_v41()
    if mtp:
        served._check_draft(None)
    return served
