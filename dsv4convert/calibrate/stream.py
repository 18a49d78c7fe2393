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
the previous block at ``t`` (see :class:`dsv4convert.model.blocks.MtpEntry`), so its
sequences are ``j + 1`` tokens shorter; it is calibrated like any layer.

DSpark (V4-Flash-0731): ``mtp.s`` is the drafter's stage ``s``, calibrated under SGLang's drafting forward
from the target features the backbone's layers left in the work directory (:mod:`.dspark`); its inputs are
``[blocks, block_size, hc_mult, hidden]`` state files instead of sequences.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from dsv4convert import __version__
from dsv4convert.calibrate.calibfile import write_calibration
from dsv4convert.calibrate.dspark import (
    FIRST_ANCHOR,
    blocks_per_sequence,
    draft_blocks,
    feature_slice,
    run_draft_stage,
    stage_chunk,
)
from dsv4convert.calibrate.report import block_errors
from dsv4convert.calibrate.stats import ExpertRecorder, ExpertStats
from dsv4convert.calibration import InputScales, build_input_scales
from dsv4convert.checkpoint import Checkpoint, atomic_write_json, read_small_json
from dsv4convert.compare.eta import Eta, Work
from dsv4convert.devices import resolve_device
from dsv4convert.distributed import World
from dsv4convert.errors import DSV4Error
from dsv4convert.inspection import inspect_checkpoint
from dsv4convert.models.deepseek_v4.names import DSparkNames, in_draft
from dsv4convert.model.blocks import COMPUTE_DTYPES, MtpEntry, WeightSource, build_layer, hf_config
from dsv4convert.model.dspark import DSparkEntry
from dsv4convert.model.forward import BlockRunner
from dsv4convert.model.text import token_windows
from dsv4convert.stop_points import reach

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


def batches(calibration: int, total: int, size: int) -> list[slice]:
    """Micro-batches of sequences that never mix calibration and held-out ones."""
    return [slice(first, min(first + size, end))
            for begin, end in ((0, calibration), (calibration, total)) for first in range(begin, end, size)]


def owner(index: int, rows: slice, calibration: int, world: World) -> int:
    """The rank that runs micro-batch ``index``: calibration ones round robin, held-out ones rank 0 (the
    held-out error report needs them all in one place)."""
    return index % world.size if rows.start < calibration else 0


def _token_digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.contiguous().numpy().tobytes()).hexdigest()


@dataclass
class StateFiles:
    """Each micro-batch's input streams to a block, ``[rows, seq, hc_mult, hidden]``, memory-mapped, one file
    per (block, micro-batch): the rank that runs a micro-batch writes it, and a resumed run with any number
    of ranks reads each micro-batch from wherever it was written (the same host or a shared filesystem)."""

    root: Path
    shape_tail: tuple[int, int]          # (hc_mult, hidden)
    dtype: torch.dtype

    def path(self, block: str, unit: int) -> Path:
        return self.root / block / f"{unit:05d}.states"

    def _map(self, path: Path, rows: int, seq: int, *, create: bool) -> torch.Tensor:
        numel = rows * seq * self.shape_tail[0] * self.shape_tail[1]
        nbytes = numel * self.dtype.itemsize
        if not create:
            if not path.exists():
                raise DSV4Error("a resumed run cannot find this micro-batch's input state (written on another "
                                "host? resume where every rank sees the work directory)", file=path)
            if path.stat().st_size != nbytes:
                raise DSV4Error(f"state file has {path.stat().st_size} bytes, expected {nbytes}", file=path)
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=self.dtype)
        return flat.view(rows, seq, *self.shape_tail)

    def open(self, block: str, unit: int, rows: int, seq: int) -> torch.Tensor:
        return self._map(self.path(block, unit), rows, seq, create=False)

    def create(self, block: str, unit: int, rows: int, seq: int) -> tuple[torch.Tensor, Path]:
        partial = self.path(block, unit).with_name(f".{unit:05d}.states.partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.unlink(missing_ok=True)
        return self._map(partial, rows, seq, create=True), partial

    def commit(self, partial: Path, block: str, unit: int) -> None:
        partial.replace(self.path(block, unit))

    def remove(self, block: str, unit: int) -> None:
        self.path(block, unit).unlink(missing_ok=True)


@dataclass
class BlockResult:
    block: str
    seconds: float
    load_seconds: float            # reading and dequantizing the layer's weights
    forward_seconds: float         # all sequences through the layer, statistics and state files included
    peak_device_bytes: int | None
    calibration_rows: int
    report: dict | None = None
    distributed: dict | None = None  # world size and each rank's calibration tokens

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None or k == "peak_device_bytes"}


class Calibrator:
    """One calibration run: checks everything up front, then :meth:`run` streams the blocks."""

    def __init__(self, opts: CalibrateOptions, world: World = World()):
        self.opts = o = opts
        self.world = world
        if o.batch_size < 1:
            raise DSV4Error(f"--batch-size must be at least 1, got {o.batch_size}")
        if o.report and o.holdout < 1:
            raise DSV4Error("--report needs held-out sequences (--holdout N, N >= 1)")
        self.device = world.device(str(resolve_device(o.device)))
        if o.dtype not in COMPUTE_DTYPES:
            raise DSV4Error(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {o.dtype!r}")
        self.dtype = COMPUTE_DTYPES[o.dtype]
        self.ckpt = Checkpoint.open(o.source)
        inspection = inspect_checkpoint(self.ckpt)
        if not inspection.ok:
            first = inspection.first_problem()
            raise DSV4Error(f"checkpoint does not match its config.json's layout ({first})", file=self.ckpt.root)
        self.cfg = inspection.config
        self.config = hf_config(self.ckpt.config)
        self.source = WeightSource(self.ckpt, inspection, self.device, self.dtype)
        self.blocks = [b for b in self.cfg.block_prefixes() if o.mtp or b.startswith("layers.")]
        self.work = work_dir(Path(o.output))
        self.states = StateFiles(self.work / "states", (self.cfg.hc_mult, self.cfg.hidden_size), self.dtype)
        # A DSpark drafter's target features, one file per (target layer, micro-batch): [rows, seq, 1, hidden].
        self.dspark = self.cfg.dspark if any(in_draft(b) for b in self.blocks) else None
        self.features = StateFiles(self.states.root / "features", (1, self.cfg.hidden_size), self.dtype)
        self.input_scales: InputScales = build_input_scales(self.ckpt)
        self._embed_weight: torch.Tensor | None = None
        self._runner = BlockRunner(self.config, self.device, self.dtype)
        self._rotary = DeepseekV4RotaryEmbedding(self.config, device=self.device)   # the DSpark stages' RoPE

    # -- setup and resume -------------------------------------------------------------------

    def _signature(self, ids: torch.Tensor) -> dict:
        o = self.opts
        tensors = hashlib.sha256(json.dumps(
            [[n, e.dtype, list(e.shape)] for n, e in self.ckpt.tensors.items()]).encode()).hexdigest()
        signature = {"producer": f"dsv4convert {__version__}", "config": self.ckpt.config, "tensors": tensors,
                "tokens": _token_digest(ids), "num_sequences": o.num_sequences, "holdout": o.holdout,
                "seq_len": o.seq_len, "batch_size": o.batch_size, "device": self.device.type, "dtype": o.dtype,
                "hessians": o.hessians, "report": o.report, "report_experts": o.report_experts,
                "gptq_damp": o.gptq_damp, "report_group_size": o.report_group_size, "blocks": self.blocks}
        if self.dspark is not None:
            signature["dspark_anchors"] = f"every position from {FIRST_ANCHOR}"
        return signature

    def _prepare(self) -> torch.Tensor:
        """Token ids of all sequences (calibration then held-out), resuming or starting the work dir."""
        o = self.opts
        calib, held = token_windows(self.ckpt.root, o.data, num_sequences=o.num_sequences, seq_len=o.seq_len,
                                         holdout=o.holdout, vocab_size=self.cfg.vocab_size)
        ids = torch.cat([calib, held])
        problem = None
        if self.world.is_main:   # rank 0 starts or checks the work directory; the others learn how that went
            try:
                self._start_work_dir(self._signature(ids))
            except DSV4Error as exc:
                problem = str(exc)
        problem = self.world.broadcast(problem)
        if problem:
            raise DSV4Error(problem)
        return ids

    def _start_work_dir(self, signature: dict) -> None:
        sig_path = self.work / SIGNATURE_FILE
        if self.work.exists() and self.opts.overwrite:
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

    def stats_path(self, block: str) -> Path:
        return self.work / f"{block}.safetensors"

    def result_path(self, block: str) -> Path:
        return self.work / f"{block}.json"

    # -- the forward ------------------------------------------------------------------------

    def _is_stage(self, block: str) -> bool:
        """``block`` is a DSpark drafter's stage (else a backbone layer or the preview's MTP block)."""
        return self.dspark is not None and in_draft(block)

    def _shift(self, block: str) -> int:
        """How many tokens shorter this block's sequences are than the calibration windows."""
        kind, idx = block.split(".")
        return 0 if kind == "layers" else int(idx) + 1

    def _out_shape(self, block: str, rows: int, seq_len: int) -> tuple[int, int]:
        """(rows, length) of a micro-batch's output streams of ``block`` (the tokens its experts calibrate on): its
        sequences, or a stage's draft blocks."""
        if self._is_stage(block):
            return rows * blocks_per_sequence(seq_len), self.dspark.block_size
        return rows, seq_len - self._shift(block)

    def _keep_features(self, block: str, unit: int, streams: torch.Tensor) -> None:
        """After a target layer: its part of the micro-batch's target features, committed with the block."""
        if self.dspark is None or in_draft(block):
            return
        if int(block.split(".")[1]) not in self.dspark.target_layer_ids:
            return
        part = feature_slice(streams)
        out, partial = self.features.create(block, unit, part.shape[0], part.shape[1])
        out.copy_(part)
        del out
        self.features.commit(partial, block, unit)

    def _target_features(self, unit: int, rows: int, seq_len: int) -> torch.Tensor:
        """A micro-batch's target features ``[rows, seq, hidden * T]``, the target layers in ascending order."""
        return torch.cat([self.features.open(f"layers.{i}", unit, rows, seq_len).to(self.device).squeeze(2)
                          for i in sorted(self.dspark.target_layer_ids)], dim=-1)

    def _draft(self, block: str, layer: nn.Module, entry: DSparkEntry, previous: torch.Tensor | None,
               ids: torch.Tensor, unit: int, rows: slice) -> torch.Tensor:
        """A micro-batch through DSpark stage ``block``: its output streams ``[blocks, block_size, hc, hidden]``."""
        n, seq_len = rows.stop - rows.start, ids.shape[1]
        features = self._target_features(unit, n, seq_len)
        blocks = draft_blocks(ids[rows].to(self.device), self.dspark, int(self.config.sliding_window))
        if previous is None:
            streams, embed = None, self._embedding()
        else:
            streams, embed = previous.to(self.device), None
        return run_draft_stage(layer, entry, features, blocks, streams, embed, self.cfg.hc_mult, self._rotary,
                               stage_chunk(n, seq_len, self.dspark.block_size))

    def _embedding(self) -> torch.Tensor:
        if self._embed_weight is None:
            self._embed_weight = self.source.tensor("embed.weight")
        return self._embed_weight

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids.to(self.device), self._embedding())

    def _inputs(self, block: str, previous: torch.Tensor | None, entry: MtpEntry | None,
                ids: torch.Tensor, rows: slice) -> torch.Tensor:
        """A micro-batch's input to ``block``: ``previous`` holds its streams out of the block before."""
        if previous is None:        # the first backbone layer: the embedding, copied to every stream
            embedded = self._embed(ids[rows])
            return embedded.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        streams = previous.to(self.device)
        if entry is None:
            return streams
        shift = self._shift(block)
        return entry(self._embed(ids[rows, shift:]), streams[:, :-1])

    @torch.no_grad()
    def run_block(self, index: int, ids: torch.Tensor) -> BlockResult:
        """This rank's micro-batches through block ``index``; the statistics of every rank combined, saved by rank 0.

        Order, for a kill at any moment: every rank commits its outputs (the next block's input states); the
        statistics are reduced (a collective: all ranks have committed); rank 0 saves them and the block's
        result; only then (after a barrier) does each rank remove its inputs to this block.
        """
        block, o = self.blocks[index], self.opts
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        rows_total, seq_len = ids.shape
        stage = self._is_stage(block)
        # A stage's first input is its anchor blocks' embedding, not the states of the block before.
        reads_states = index > 0 and not (stage and block == DSparkNames.stage(0))
        layer = build_layer(self.source, self.config, self.cfg, block)
        entry: MtpEntry | DSparkEntry | None = None
        if stage:
            entry = DSparkEntry.load(self.source, self.config, self.cfg)
        elif in_draft(block):
            entry = MtpEntry.load(self.source, self.config, block)
        loaded = time.perf_counter()
        stats = ExpertStats.zeros(self.cfg.experts_in(block), self.cfg.hidden_size, self.cfg.moe_intermediate_size,
                                  hessians=o.hessians or o.report, device=self.device)
        recorder = ExpertRecorder(layer.mlp.experts, stats)
        following = self.blocks[index + 1] if index + 1 < len(self.blocks) else None
        has_next = following is not None and not (self._is_stage(following) and following == DSparkNames.stage(0))
        mine = [(i, rows) for i, rows in enumerate(batches(o.num_sequences, rows_total, o.batch_size))
                if owner(i, rows, o.num_sequences, self.world) == self.world.rank]
        try:
            for i, rows in mine:
                recorder.capture = rows.start >= o.num_sequences
                n = rows.stop - rows.start
                previous = (self.states.open(block, i, *self._out_shape(self.blocks[index - 1], n, seq_len))
                            if reads_states else None)
                if stage:
                    streams = self._draft(block, layer, entry, previous, ids, i, rows)
                else:
                    hidden = self._inputs(block, previous, entry, ids, rows)
                    streams = self._runner(layer, hidden, ids[rows, self._shift(block):])
                    self._keep_features(block, i, streams)
                if has_next:
                    out, partial = self.states.create(following, i, *self._out_shape(block, n, seq_len))
                    out.copy_(streams)
                    del out
                    self.states.commit(partial, following, i)
                reach(f"calibrate: {block}: micro-batch {i} done")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            recorder.remove()
        forwarded = time.perf_counter()
        self._combine(stats)
        calibration_tokens = sum(math.prod(self._out_shape(block, r.stop - r.start, seq_len)) for _, r in mine
                                 if r.start < o.num_sequences)
        tokens_per_rank = self.world.gather(calibration_tokens)
        report = None
        if o.report and self.world.is_main:
            report = block_errors(layer.mlp.experts, recorder.captured, stats, self._data_free(block),
                                  max_experts=o.report_experts, group_size=o.report_group_size, damp=o.gptq_damp)
        if not o.hessians:
            stats.w13_hessian = stats.w2_hessian = None
        del layer, entry, recorder
        self._embed_weight = None   # only the first layer, the MTP blocks and DSpark stage 0 read the embedding
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        result = BlockResult(block, time.perf_counter() - start, loaded - start, forwarded - loaded, peak,
                             math.prod(self._out_shape(block, o.num_sequences, seq_len)), report,
                             self.world.describe(tokens_per_rank or []))
        if self.world.is_main:
            stats.save(self.stats_path(block))
            atomic_write_json(self.result_path(block), result.as_dict())
        self.world.barrier()
        if index > 0:
            for i, _ in mine:
                self.states.remove(block, i)
        return result

    def _combine(self, stats: ExpertStats) -> None:
        """Every rank's statistics in every rank: maxima and token counts exactly, Hessians summed by the backend."""
        self.world.reduce_(stats.tokens, "sum")
        self.world.reduce_(stats.w13_amax, "max")
        self.world.reduce_(stats.w2_amax, "max")
        if stats.w13_hessian is not None:
            self.world.reduce_(stats.w13_hessian, "sum")
            self.world.reduce_(stats.w2_hessian, "sum")

    def _data_free(self, block: str) -> tuple[float, float]:
        expert = f"{block}.ffn.experts.0"
        return (self.input_scales.data_free_amax(f"{expert}.w1"), self.input_scales.data_free_amax(f"{expert}.w2"))

    def expected(self, ids: torch.Tensor, blocks: list[str]) -> Eta:
        """Announces the expected time of the ``blocks`` still to calibrate (every sequence, held-out ones
        included, through each; a DSpark stage routes its draft blocks' rows; a resumed run counts only what is
        left) before the first one starts."""
        tokens = [math.prod(self._out_shape(b, ids.shape[0], ids.shape[1])) for b in blocks]
        eta = Eta("calibrate", self.cfg, Work(sum(tokens), 0, ids.shape[1] // 2, tokens[0]), self.device, self.dtype)
        eta.announce(f"{len(blocks)} block(s) x {ids.shape[0]} x {ids.shape[1]} tokens")
        return eta

    def run(self) -> dict:
        """Calibrate every block not yet done, then write the calibration file; returns its contents."""
        ids = self._prepare()
        # what rank 0 sees decides: its files are the record
        todo = [not self.world.broadcast(self.stats_path(b).exists() and self.result_path(b).exists())
                for b in self.blocks]
        left = [b for b, wanted in zip(self.blocks, todo) if wanted]
        eta = self.expected(ids, left) if self.world.is_main and left else None
        done = 0
        for index, block in enumerate(self.blocks):
            if not todo[index]:
                continue
            if self.opts.max_blocks is not None and done >= self.opts.max_blocks:
                return {}
            result = self.run_block(index, ids)
            done += 1
            if eta is not None and done == 1:
                eta.refine(result.seconds)
            if self.opts.progress and self.world.is_main:
                peak = f", peak {result.peak_device_bytes / 2**30:.1f} GiB" if result.peak_device_bytes else ""
                print(f"calibrate: {block} done in {result.seconds:.1f} s{peak}", file=sys.stderr)
        if not self.world.is_main:
            return {}
        shutil.rmtree(self.states.root, ignore_errors=True)
        return write_calibration(self, ids)
