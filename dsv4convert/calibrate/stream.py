"""The layer-streaming forward: calibration tokens through the model one block at a time.

For each block (backbone layers in order, then the MTP blocks): build transformers' decoder
layer with that block's weights only, push every sequence's hyper-connection streams
``[S, hc_mult, hidden]`` through it in micro-batches while a hook records the per-expert
statistics, write the output streams to a memory-mapped file on disk, and free the layer.
Device memory is one layer's weights, the statistics (the Hessians if asked for) and one
micro-batch's activations; host memory is what the page cache gives the state files.

Resumable per block: a work directory beside the output holds a signature of everything
that determines the result, the input streams of the next block and one statistics file
per finished block; an interrupted run continues at the first unfinished block.

MTP: transformers does not instantiate the MTP block, but its body is an ordinary decoder
layer. Block ``mtp.j`` reads, at position ``t``, the token ``t + j + 1`` and the streams of
the previous block at ``t`` (see :class:`dsv4convert.calibrate.layers.MtpEntry`), so its
sequences are ``j + 1`` tokens shorter; it is calibrated like any layer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from dsv4convert import __version__
from dsv4convert.calibrate.data import calibration_tokens
from dsv4convert.calibrate.layers import COMPUTE_DTYPES, MtpEntry, Positions, WeightSource, build_layer, hf_config
from dsv4convert.calibrate.report import block_errors
from dsv4convert.calibrate.stats import ExpertRecorder, ExpertStats
from dsv4convert.checkpoint import Checkpoint, atomic_write_json, read_small_json
from dsv4convert.convert.input_scales import InputScales, build_input_scales
from dsv4convert.errors import DSV4Error
from dsv4convert.inspection import inspect_checkpoint

SIGNATURE_FILE = "signature.json"


@dataclass
class CalibrateOptions:
    source: str | Path
    output: Path
    data: Path
    num_sequences: int = 128
    seq_len: int = 2048
    holdout: int = 0
    batch_size: int = 1
    device: str = "cpu"
    dtype: str = "bfloat16"
    hessians: bool = False
    report: bool = False
    report_experts: int = 8
    mtp: bool = True
    overwrite: bool = False
    progress: bool = True
    gptq_damp: float = 0.01
    report_group_size: int = 32       # INT4 group of the report's RTN/GPTQ rows (the w4a16 recipe's)
    max_blocks: int | None = None   # stop after this many blocks (benchmarks); the run stays resumable


def work_dir(output: Path) -> Path:
    """Where the per-block statistics (and Hessians) and the streaming state live."""
    return output.parent / f"{output.name}.d"


def resolve_device(name: str) -> torch.device:
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise DSV4Error(f"--device must be cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DSV4Error("--device cuda but torch sees no CUDA device")
    return torch.device(name)


def batches(calibration: int, total: int, size: int) -> list[slice]:
    """Micro-batches of sequences that never mix calibration and held-out ones."""
    return [slice(first, min(first + size, end))
            for begin, end in ((0, calibration), (calibration, total)) for first in range(begin, end, size)]


def _token_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.contiguous().numpy().tobytes()).hexdigest()


@dataclass
class StateFiles:
    """Each block's input streams ``[sequences, seq, hc_mult, hidden]``, memory-mapped."""

    root: Path
    shape_tail: tuple[int, int]          # (hc_mult, hidden)
    dtype: torch.dtype

    def path(self, block: str) -> Path:
        return self.root / f"{block}.states"

    def _map(self, path: Path, rows: int, seq: int, *, create: bool) -> torch.Tensor:
        numel = rows * seq * self.shape_tail[0] * self.shape_tail[1]
        nbytes = numel * self.dtype.itemsize
        if not create and path.stat().st_size != nbytes:
            raise DSV4Error(f"state file has {path.stat().st_size} bytes, expected {nbytes}", file=path)
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=self.dtype)
        return flat.view(rows, seq, *self.shape_tail)

    def open(self, block: str, rows: int, seq: int) -> torch.Tensor:
        return self._map(self.path(block), rows, seq, create=False)

    def create(self, block: str, rows: int, seq: int) -> tuple[torch.Tensor, Path]:
        partial = self.root / f".{block}.states.partial"
        partial.unlink(missing_ok=True)
        return self._map(partial, rows, seq, create=True), partial

    def commit(self, partial: Path, block: str) -> None:
        partial.replace(self.path(block))


@dataclass
class BlockResult:
    block: str
    seconds: float
    load_seconds: float            # reading and dequantizing the layer's weights
    forward_seconds: float         # all sequences through the layer, statistics and state files included
    peak_device_bytes: int | None
    calibration_rows: int
    report: dict | None = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "peak_device_bytes"}


@dataclass
class _ExpertModule:
    """The one field :meth:`InputScales.data_free_amax` reads of a conversion job."""

    module: str


class Calibrator:
    """One calibration run: checks everything up front, then :meth:`run` streams the blocks."""

    def __init__(self, opts: CalibrateOptions):
        self.opts = o = opts
        if o.batch_size < 1:
            raise DSV4Error(f"--batch-size must be at least 1, got {o.batch_size}")
        if o.report and o.holdout < 1:
            raise DSV4Error("--report needs held-out sequences (--holdout N, N >= 1)")
        self.device = resolve_device(o.device)
        if o.dtype not in COMPUTE_DTYPES:
            raise DSV4Error(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {o.dtype!r}")
        self.dtype = COMPUTE_DTYPES[o.dtype]
        self.ckpt = Checkpoint.open(o.source)
        inspection = inspect_checkpoint(self.ckpt)
        if not inspection.ok:
            first = (inspection.missing + inspection.unexpected + inspection.mismatched + inspection.problems)[0]
            raise DSV4Error(f"checkpoint does not match its config.json's layout ({first})", file=self.ckpt.root)
        self.cfg = inspection.config
        self.config = hf_config(self.ckpt.config)
        self.source = WeightSource(self.ckpt, inspection, self.device, self.dtype)
        self.blocks = [b for b in self.cfg.block_prefixes() if o.mtp or b.startswith("layers.")]
        self.work = work_dir(Path(o.output))
        self.states = StateFiles(self.work / "states", (self.cfg.hc_mult, self.cfg.hidden_size), self.dtype)
        self.input_scales: InputScales = build_input_scales(self.ckpt)
        self._embed_weight: torch.Tensor | None = None
        self._positions = Positions(self.config, self.device, self.dtype)

    # -- setup and resume -------------------------------------------------------------------

    def _signature(self, ids: torch.Tensor) -> dict:
        o = self.opts
        tensors = hashlib.sha256(json.dumps(
            [[n, e.dtype, list(e.shape)] for n, e in self.ckpt.tensors.items()]).encode()).hexdigest()
        return {"producer": f"dsv4convert {__version__}", "config": self.ckpt.config, "tensors": tensors,
                "tokens": _token_digest(ids), "num_sequences": o.num_sequences, "holdout": o.holdout,
                "seq_len": o.seq_len, "batch_size": o.batch_size, "device": self.device.type, "dtype": o.dtype,
                "hessians": o.hessians, "report": o.report, "report_experts": o.report_experts,
                "gptq_damp": o.gptq_damp, "report_group_size": o.report_group_size, "blocks": self.blocks}

    def _prepare(self) -> torch.Tensor:
        """Token ids of all sequences (calibration then held-out), resuming or starting the work dir."""
        o = self.opts
        calib, held = calibration_tokens(self.ckpt.root, o.data, num_sequences=o.num_sequences, seq_len=o.seq_len,
                                         holdout=o.holdout, vocab_size=self.cfg.vocab_size)
        ids = torch.cat([calib, held])
        signature = self._signature(ids)
        sig_path = self.work / SIGNATURE_FILE
        if self.work.exists() and o.overwrite:
            shutil.rmtree(self.work)
        if sig_path.exists():
            if read_small_json(sig_path) != signature:
                raise DSV4Error("the work directory was made with another checkpoint, data or options; "
                                "pass --overwrite to start over", file=self.work)
        elif self.work.exists() and any(self.work.iterdir()):
            raise DSV4Error("work directory exists and is not a calibration run; pass --overwrite", file=self.work)
        else:
            self.states.root.mkdir(parents=True, exist_ok=True)
            atomic_write_json(sig_path, signature)
        return ids

    def stats_path(self, block: str) -> Path:
        return self.work / f"{block}.safetensors"

    def result_path(self, block: str) -> Path:
        return self.work / f"{block}.json"

    # -- the forward ------------------------------------------------------------------------

    def _shift(self, block: str) -> int:
        """How many tokens shorter this block's sequences are than the calibration windows."""
        kind, idx = block.split(".")
        return 0 if kind == "layers" else int(idx) + 1

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._embed_weight is None:
            self._embed_weight = self.source.tensor("embed.weight")
        return F.embedding(ids.to(self.device), self._embed_weight)

    def _inputs(self, block: str, previous: torch.Tensor | None, entry: MtpEntry | None,
                ids: torch.Tensor, rows: slice) -> torch.Tensor:
        if previous is None:        # the first backbone layer: the embedding, copied to every stream
            embedded = self._embed(ids[rows])
            return embedded.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        streams = previous[rows].to(self.device)
        if entry is None:
            return streams
        shift = self._shift(block)
        return entry(self._embed(ids[rows, shift:]), streams[:, :-1])

    @torch.no_grad()
    def run_block(self, index: int, ids: torch.Tensor) -> BlockResult:
        block, o = self.blocks[index], self.opts
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        rows_total, seq = ids.shape[0], ids.shape[1] - self._shift(block)
        previous = None
        if index > 0:
            previous = self.states.open(block, rows_total, ids.shape[1] - self._shift(self.blocks[index - 1]))
        layer = build_layer(self.source, self.config, self.cfg, block)
        entry = MtpEntry.load(self.source, self.config, block) if block.startswith("mtp.") else None
        loaded = time.perf_counter()
        stats = ExpertStats.zeros(self.cfg.n_routed_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size,
                                  hessians=o.hessians or o.report, device=self.device)
        recorder = ExpertRecorder(layer.mlp.experts, stats)
        has_next = index + 1 < len(self.blocks)
        out, partial = (self.states.create(self.blocks[index + 1], rows_total, seq) if has_next else (None, None))
        try:
            for rows in batches(o.num_sequences, rows_total, o.batch_size):
                recorder.capture = rows.start >= o.num_sequences
                hidden = self._inputs(block, previous, entry, ids, rows)
                kwargs = self._positions.kwargs(hidden.shape[0], seq)
                streams = layer(hidden, input_ids=ids[rows, self._shift(block):].to(self.device), **kwargs)
                if out is not None:
                    out[rows] = streams.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            recorder.remove()
        forwarded = time.perf_counter()
        report = None
        if o.report:
            report = block_errors(layer.mlp.experts, recorder.captured, stats, self._data_free(block),
                                  max_experts=o.report_experts, group_size=o.report_group_size, damp=o.gptq_damp)
            if not o.hessians:
                stats.w13_hessian = stats.w2_hessian = None
        del layer, entry, recorder
        self._embed_weight = None   # only the first layer and the MTP blocks read the embedding
        stats.save(self.stats_path(block))
        if partial is not None:
            del out
            self.states.commit(partial, self.blocks[index + 1])
        if previous is not None:
            del previous
            self.states.path(block).unlink(missing_ok=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        result = BlockResult(block, time.perf_counter() - start, loaded - start, forwarded - loaded, peak,
                             o.num_sequences * seq, report)
        atomic_write_json(self.result_path(block), result.as_dict())
        return result

    def _data_free(self, block: str) -> tuple[float, float]:
        expert = f"{block}.ffn.experts.0"
        return (self.input_scales.data_free_amax(_ExpertModule(f"{expert}.w1")),
                self.input_scales.data_free_amax(_ExpertModule(f"{expert}.w2")))

    def run(self) -> dict:
        """Calibrate every block not yet done, then write the calibration file; returns its contents."""
        from dsv4convert.calibrate.calibfile import write_calibration

        ids = self._prepare()
        done = 0
        for index, block in enumerate(self.blocks):
            if self.stats_path(block).exists() and self.result_path(block).exists():
                continue
            if self.opts.max_blocks is not None and done >= self.opts.max_blocks:
                return {}
            result = self.run_block(index, ids)
            done += 1
            if self.opts.progress:
                peak = f", peak {result.peak_device_bytes / 2**30:.1f} GiB" if result.peak_device_bytes else ""
                print(f"calibrate: {block} done in {result.seconds:.1f} s{peak}", file=sys.stderr)
        shutil.rmtree(self.states.root, ignore_errors=True)
        return write_calibration(self, ids)
