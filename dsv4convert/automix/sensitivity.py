"""The sensitivity pass: every candidate's effect on the model's output, measured, in one streamed pass.

The estimator is a measured KL divergence, not a proxy: a candidate's cost is the mean
``KL(reference || model)`` over the text's positions when that candidate alone is applied (its block
stored in its format and rounded as its server rounds it) and every other block computes as the
reference does. The reference is the base as released, weights only (the numbers the model was made
with); the served caches' rounding that no format choice changes (FP8 KV cache, the indexer's FP8/FP4
cache) is one more measured term, the *floor*. A mix is predicted to cost the floor plus the sum of its
candidates' costs, each scaled by its *calibration*: isolated costs do not add up (on the trained organism
the sum of the isolated costs of every layer's INT4 experts is twice the KLD of all of them together, the FP8
sum 1.7x), so the pass also runs, for each format a layout offers, one whole-model track with that format
applied everywhere at once, and each cost of that format is scaled by the measured KLD of that track over
the sum of its isolated costs. Scaling keeps the solver's problem additive (so exactly solvable) while the
predicted KLD of whole mixes matches what ``compare`` measures; ``automix`` reports predicted against
measured for every mix it writes. (ModelOpt's AutoQuantize sums isolated scores and says in its docs the
total "is not always the sum"; here the gap is measured and corrected.)

One pass reads each block once. The reference's streams go through block after block; at block ``k``
each candidate of ``k`` runs on the reference's input and starts its own streams (a *fork*), and every
fork started earlier goes on through the base's block ``k`` as the reference does. So a candidate's
measurement costs the rest of the model's forward for its tokens: blocks x candidates / 2 layer passes
in all, one read of the model, host memory for every fork's streams (:func:`host_bytes`). Calibration
tracks and the floor each cost one pass per block.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dsv4convert.automix.candidates import Candidate, CandidateMaker, CandidateView, Swapped, is_exact
from dsv4convert.calibration import InputScales
from dsv4convert.checkpoint import Checkpoint
from dsv4convert.compare.emulate import install
from dsv4convert.compare.lockstep import HEAD_POSITIONS
from dsv4convert.compare.metrics import OutputStats
from dsv4convert.compare.numerics import Numerics, Serving, served
from dsv4convert.formats import Format
from dsv4convert.inspection import Inspection
from dsv4convert.model.blocks import OutputHead, WeightSource, build_layer, hf_config
from dsv4convert.model.forward import BlockRunner


@dataclass(frozen=True)
class Probe:
    """One candidate to measure: its modules and the server whose rounding it gets."""

    candidate: Candidate
    modules: tuple[str, ...]
    serving: Serving


@dataclass(frozen=True)
class Calibration:
    """A whole-model track with ``probes`` all applied (each in its block), to measure how their costs add up."""

    label: str
    probes: tuple[Probe, ...]


@dataclass(frozen=True)
class MixTrack:
    """A whole mix on one track: its candidates (``probes``, each in its block; a decision stored exactly has
    none) under everything ``serving`` computes with, the served caches included: what ``compare`` measures
    on the mix once converted, without converting it."""

    label: str
    probes: tuple[Probe, ...]
    serving: Serving

    def at(self, block: str) -> list[Probe]:
        return [p for p in self.probes if p.candidate.decision.block == block]


@dataclass
class Measured:
    costs: dict[Candidate, float]             # mean KLD per position against the reference
    floors: dict[str, float]                  # floor label -> mean KLD of the served caches alone
    calibrations: dict[str, float]            # calibration label -> mean KLD of its whole-model track
    positions: int
    sequences: int
    seq_len: int
    seconds: dict[str, float] = field(default_factory=dict)
    blocks: list[dict] = field(default_factory=list)      # per block: seconds of each part and passes run
    bank: str = "host"                                    # where the forks' streams lived
    mixes: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)  # mix label -> KLD per position

    def mix_kld(self, label: str) -> float:
        return float(self.mixes[label].double().mean())

    def mix_error(self, label: str, against: str | None = None) -> float:
        """Standard error of a mix track's mean KLD, or of its difference from ``against``'s (the same
        positions: the paired error, smaller than either alone)."""
        values = self.mixes[label].double() - (self.mixes[against].double() if against is not None else 0)
        return float(values.std() / math.sqrt(values.numel())) if values.numel() > 1 else 0.0

    def to_json(self) -> dict:
        return {"positions": self.positions, "sequences": self.sequences, "seq_len": self.seq_len,
                "floors": self.floors, "calibrations": self.calibrations,
                "mixes": {label: {"kld": self.mix_kld(label), "standard_error": self.mix_error(label)}
                          for label in self.mixes}, "seconds": self.seconds,
                "blocks": self.blocks, "bank": self.bank,
                "candidates": [{"block": c.decision.block, "group": c.decision.group, "format": c.scheme.format.value,
                                "rounding": c.scheme.rounding, "kld": cost} for c, cost in self.costs.items()]}


def floor_numerics(serving: Serving) -> Numerics:
    """The served caches alone (the part of the served numerics no format choice changes)."""
    return served(serving).with_parts(activations=False)


def floor_label(serving: Serving) -> str:
    return floor_numerics(serving).label


def stream_bytes(streams: int, tokens: int, hc_mult: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes of ``streams`` hyper-connection streams over ``tokens`` tokens: the pass holds one per fork and
    whole-model track (:class:`ForkBank`), plus the reference's two."""
    return streams * tokens * hc_mult * hidden * torch.empty((), dtype=dtype).element_size()


LAYER_COPIES = 3


class ForkBank:
    """Every fork's streams in one tensor ``[forks x sequences, seq, hc_mult, hidden]``.

    On the device when it fits beside ``reserve`` bytes (``place="auto"``), else in page-locked host memory
    (registered in place, as compare's host streams: torch's pinned allocator rounds up to a power of two).
    Forks go through a base block ``per_forward`` at a time, in place: a block's forward reads each query
    chunk before it writes that chunk's output (from the host, the copies are ordered on one stream).
    """

    def __init__(self, count: int, ids: torch.Tensor, hc_mult: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, batch_tokens: int, reserve: int = 0, place: str = "auto"):
        shape = (max(count, 1) * ids.shape[0], ids.shape[1], hc_mult, hidden)
        self.bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        on_gpu = device.type == "cuda" and (
            place == "device" or (place == "auto" and self.bytes + reserve < torch.cuda.mem_get_info(device)[0]))
        self.data = torch.empty(shape, dtype=dtype, device=device if on_gpu else "cpu")
        self.registered = device.type == "cuda" and not on_gpu
        if self.registered:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.bytes, 0))
        self.ids, self.rows = ids, ids.shape[0]
        self.per_forward = max(1, batch_tokens // ids.numel())
        self.index: dict[object, int] = {}

    @property
    def on_device(self) -> bool:
        return self.data.device.type == "cuda"

    def close(self) -> None:
        if self.registered:
            torch.cuda.synchronize()
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr()))
            self.registered = False

    def slot(self, key: object) -> torch.Tensor:
        """The streams of ``key`` (a new slot for a new key)."""
        i = self.index.setdefault(key, len(self.index))
        return self.data[i * self.rows:(i + 1) * self.rows]

    def advance(self, layer, runner: BlockRunner) -> None:
        """Every fork through ``layer`` as the reference computes it."""
        used = len(self.index) * self.rows
        step = self.per_forward * self.rows
        for start in range(0, used, step):
            part = self.data[start:min(start + step, used)]
            runner(layer, part, self.ids.repeat(part.shape[0] // self.rows, 1), out=part)


def bank_reserve(cfg, dtype: torch.dtype) -> int:
    """Device bytes kept free beside the bank: ``LAYER_COPIES`` of a block's routed experts in the compute dtype
    (the layer, a candidate's copy, their conversion temporaries) and 16 GiB for one forward's activations."""
    item = torch.empty((), dtype=dtype).element_size()
    return LAYER_COPIES * cfg.n_routed_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size * item + 16 * 2**30


def measure(ckpt: Checkpoint, inspection: Inspection, ids: torch.Tensor, probes: list[Probe],
            floors: dict[str, Numerics], calibrations: list[Calibration], *, device: torch.device,
            dtype: torch.dtype, chunk: int | None, input_scales: InputScales | None, mixes: list[MixTrack] = (),
            batch_tokens: int = 16384, bank_place: str = "auto", progress: bool = True,
            desc: str = "automix sensitivity", first_block: Callable[[float], None] | None = None) -> Measured:
    """Run the pass over ``ids`` ``[sequences, seq_len]``; see the module docstring. ``mixes``: whole mixes
    measured on tracks of their own (each block's candidates made once for every track and fork that uses
    them). ``bank_place``: where the forks' streams live (auto, device, host; :class:`ForkBank`). ``first_block`` is
    told the first block's seconds (the expected-time line's refinement)."""
    t0 = time.perf_counter()
    cfg = inspection.config
    config = hf_config(ckpt.config)
    source = WeightSource(ckpt, inspection, device, dtype)
    apply = _Applier(source, CandidateMaker(ckpt, device, dtype, input_scales))
    runner = BlockRunner(config, device, dtype, chunk=chunk)
    seconds = {"read": 0.0, "candidates": 0.0, "forks": 0.0, "tracks": 0.0, "mixes": 0.0, "reference": 0.0,
               "head": 0.0}
    by_block: dict[str, list[Probe]] = {}
    for probe in probes:
        by_block.setdefault(probe.candidate.decision.block, []).append(probe)
    labels = [*floors, *(c.label for c in calibrations), *(m.label for m in mixes)]
    # One allocation: the forks, then the whole-model tracks, then the reference's next streams.
    bank = ForkBank(len(probes) + len(labels) + 1, ids, cfg.hc_mult, cfg.hidden_size, dtype, device, batch_tokens,
                    reserve=bank_reserve(cfg, dtype), place=bank_place)
    try:
        with torch.no_grad():
            embed = source.tensor("embed.weight")
            reference = (F.embedding(ids.to(device), embed).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)
                         .to(bank.data.device, dtype).contiguous())
            del embed
            offset = len(probes)
            track_rows = {label: bank.data[(offset + i) * ids.shape[0]:(offset + i + 1) * ids.shape[0]]
                          for i, label in enumerate(labels)}
            scratch = bank.data[(offset + len(labels)) * ids.shape[0]:(offset + len(labels) + 1) * ids.shape[0]]
            for rows in track_rows.values():
                rows.copy_(reference)
            blocks = [b for b in cfg.block_prefixes() if b.startswith("layers.")]
            bar = tqdm(blocks, desc=desc, unit="block", disable=not progress)
            per_block: list[dict] = []
            for block in bar:
                before, forks_before = dict(seconds), len(bank.index)
                t = time.perf_counter()
                staged = source.read_block(block)
                with source.staged(staged):
                    layer = build_layer(source, config, cfg, block)
                seconds["read"] += time.perf_counter() - t
                t = time.perf_counter()
                bank.advance(layer, runner)
                seconds["forks"] += time.perf_counter() - t
                t = time.perf_counter()
                for label, numerics in floors.items():
                    installed = install(layer, block, numerics, source)
                    try:
                        runner(layer, track_rows[label], ids, out=track_rows[label])
                    finally:
                        installed.remove()
                here = {c.label: [p for p in c.probes if p.candidate.decision.block == block] for c in calibrations}
                for label, members in here.items():
                    if len(members) != 1:       # one candidate's tracks run below, with its weights made once
                        with apply(layer, block, members, staged):
                            runner(layer, track_rows[label], ids, out=track_rows[label])
                seconds["tracks"] += time.perf_counter() - t
                # Mixes by their experts' candidate here (None: stored exactly), so each is made once.
                by_experts: dict[Candidate | None, list[MixTrack]] = {}
                for mix in mixes:
                    experts = next((p for p in mix.at(block) if p.candidate.decision.group == "experts"), None)
                    by_experts.setdefault(experts.candidate if experts else None, []).append(mix)
                for probe in by_block.get(block, []):
                    t = time.perf_counter()
                    with apply.weights(layer, block, [probe], staged) as made:
                        with apply.numerics(layer, block, [made], Numerics(probe.serving, activations=True)):
                            runner(layer, reference, ids, out=bank.slot(probe.candidate))
                            for label, members in here.items():
                                if members == [probe]:
                                    runner(layer, track_rows[label], ids, out=track_rows[label])
                        seconds["candidates"] += time.perf_counter() - t
                        t = time.perf_counter()
                        _run_mixes(apply, runner, layer, block, staged, by_experts.pop(probe.candidate, []), made,
                                   track_rows, ids)
                        seconds["mixes"] += time.perf_counter() - t
                t = time.perf_counter()
                for candidate, group in by_experts.items():   # experts no fork made here
                    experts = [p for p in group[0].at(block) if p.candidate == candidate]
                    with apply.weights(layer, block, experts, staged) as made:
                        _run_mixes(apply, runner, layer, block, staged, group, made, track_rows, ids)
                seconds["mixes"] += time.perf_counter() - t
                t = time.perf_counter()
                runner(layer, reference, ids, out=scratch)
                reference, scratch = scratch, reference
                seconds["reference"] += time.perf_counter() - t
                bar.set_postfix(candidates=len(bank.index))
                per_block.append({"block": block, "fork_passes": forks_before, "n_candidates": len(by_block.get(block, [])),
                                  "n_tracks": len(labels), **{k: round(seconds[k] - before[k], 4) for k in seconds}})
                del layer, staged
                if len(per_block) == 1 and first_block is not None:
                    first_block(time.perf_counter() - t0)
            bar.close()
            if progress:      # the heads' pass is one step: say what the finished bar is waiting for
                tqdm.write(f"{desc}: the output head on {len(bank.index) + len(track_rows)} streams")
            t = time.perf_counter()
            streams = {**{key: bank.slot(key) for key in list(bank.index)}, **track_rows}
            stats = _score(source, config, reference, streams, ids, device)
            seconds["head"] = time.perf_counter() - t
        seconds["total"] = time.perf_counter() - t0

        def mean(key) -> float:
            return float(stats[key].double().mean())

        return Measured({p.candidate: mean(p.candidate) for p in probes}, {k: mean(k) for k in floors},
                        {c.label: mean(c.label) for c in calibrations}, (ids.shape[1] - 1) * ids.shape[0],
                        ids.shape[0], ids.shape[1], {k: round(v, 3) for k, v in seconds.items()}, per_block,
                        "device" if bank.on_device else "host", {m.label: stats[m.label] for m in mixes})
    finally:
        bank.close()


def _run_mixes(apply: "_Applier", runner: BlockRunner, layer, block: str, staged: dict[str, torch.Tensor],
               mixes: list[MixTrack], experts: "Applied", rows: dict[str, torch.Tensor], ids: torch.Tensor) -> None:
    """Each mix's track through ``layer`` with its experts (already ``experts``) and its other candidates applied,
    under its full served numerics."""
    for mix in mixes:
        others = [p for p in mix.at(block) if p.candidate.decision.group != "experts"]
        with apply.weights(layer, block, others, staged) as made, \
                apply.numerics(layer, block, [experts, made], served(mix.serving)):
            runner(layer, rows[mix.label], ids, out=rows[mix.label])


@dataclass
class Applied:
    """Candidates' weights in a built layer: each module's stored format, and the stored tensors the emulation
    reads (NVFP4 input scales)."""

    formats: dict[str, Format]
    stored: dict[str, torch.Tensor]


class _Applier:
    """Applies candidates to a built layer (their weights, then their served rounding) and takes them off."""

    def __init__(self, source: WeightSource, maker: CandidateMaker):
        self.source, self.maker = source, maker

    @contextlib.contextmanager
    def __call__(self, layer, block: str, probes: list[Probe], staged: dict[str, torch.Tensor]) -> Iterator[None]:
        """The probes' weights, rounded as their server rounds them (and nothing else)."""
        if not probes:
            yield
            return
        with self.weights(layer, block, probes, staged) as made, \
                self.numerics(layer, block, [made], Numerics(probes[0].serving, activations=True)):
            yield

    @contextlib.contextmanager
    def weights(self, layer, block: str, probes: list[Probe], staged: dict[str, torch.Tensor]) -> Iterator[Applied]:
        applied = Applied({}, {})
        swaps: list[Swapped] = []
        try:
            for probe in probes:
                scheme, group = probe.candidate.scheme, probe.candidate.decision.group
                modules = list(probe.modules)
                source_format = self.source.format_of(modules[0])
                applied.formats.update({m: scheme.format for m in modules})
                if scheme.format is not source_format and not is_exact(scheme, source_format):
                    made = self.maker.made(modules, scheme.format, group, staged, applied.stored)
                    swaps.append(Swapped(layer, block, group, made))
            yield applied
        finally:
            for swap in reversed(swaps):
                swap.restore()

    @contextlib.contextmanager
    def numerics(self, layer, block: str, applied: list[Applied], numerics: Numerics) -> Iterator[None]:
        """``numerics`` installed as if only the ``applied`` modules were stored quantized."""
        view = CandidateView(self.source, {m: f for a in applied for m, f in a.formats.items()},
                             {n: t for a in applied for n, t in a.stored.items()})
        installed = install(layer, block, numerics, view)
        try:
            yield
        finally:
            installed.remove()


def _score(source: WeightSource, config, reference: torch.Tensor, forks: dict, ids: torch.Tensor,
           device: torch.device) -> dict:
    """The KLD of each fork's next-token distribution against the reference's, at every scored position."""
    head = OutputHead(source, config)
    stats = {key: OutputStats() for key in forks}
    seq = ids.shape[1] - 1
    for row in range(ids.shape[0]):
        for start in range(0, seq, HEAD_POSITIONS):
            end = min(start + HEAD_POSITIONS, seq)
            nxt = ids[row, start + 1:end + 1]
            ref = head(reference[row:row + 1, start:end].to(device))[0]
            for key, streams in forks.items():
                stats[key].add(ref, head(streams[row:row + 1, start:end].to(device))[0], nxt)
    return {key: s.kld_values() for key, s in stats.items()}
