"""The conversion fast paths: pipelined shard jobs, the device plumbing, partner reads, synth's MXFP4 draw.

The pipeline must write exactly what a plain module-by-module loop writes; the GPU path's
host staging is exercised on CPU tensors (``stage_host``) so its plumbing is checked here,
and the bytes against a real GPU in bench/convert.py's GPU run.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch

from dsv4convert.calibration import build_input_scales
from dsv4convert.checkpoint import (
    Checkpoint,
    PlannedTensor,
    ShardWriter,
    SourceBytes,
    prefetch,
    read_pieces,
    read_tensor,
)
from dsv4convert.checkpoint import writer as shard_writer
from dsv4convert.cli import main
from dsv4convert.convert import execute, pipeline
from dsv4convert.convert.modules import ModuleContext, ModuleInputs, convert_module, partner_params, read_module
from dsv4convert.convert.pipeline import DeviceTransfer, pipeline_memory, run_shard_job
from dsv4convert.convert.plan import build_plan
from dsv4convert.convert.recipe import load_recipe
from dsv4convert.devices import resolve_device
from dsv4convert.errors import CheckpointError, DSV4Error
from dsv4convert.formats import dequantize_mxfp4, mxfp4_to_fp8_block, mxfp4_to_nvfp4, nvfp4_global_exponent
from dsv4convert.synth import realistic_mxfp4

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def plans(tiny_ckpt):
    ckpt = Checkpoint.open(tiny_ckpt)
    return ckpt, {r: build_plan(ckpt, load_recipe(r), max_shard_bytes=2_000_000) for r in ("nvfp4", "fp8", "w4a16")}


def _partners(plan, shard):
    return {m.module: plan.modules[m.partner].sources for m in shard.modules if m.partner}


def _sequential(dst: Path, plan, shard, input_scales) -> bytes:
    """The reference: convert and write module after module, no threads."""
    path = dst / shard.name
    with ShardWriter(path, shard.planned, metadata={"format": "pt"}) as writer:
        for module in shard.modules:
            ctx = ModuleContext(partner_sources=_partners(plan, shard).get(module.module, {}), input_scale=input_scales)
            for name, tensor in convert_module(module, ctx).tensors:
                writer.write(name, tensor)
    return path.read_bytes()


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8", "w4a16"])
@pytest.mark.parametrize("threads", [1, 3])
def test_pipeline_and_staged_transfer_write_the_sequential_bytes(plans, recipe, threads, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "CONVERT_THREADS", threads)
    ckpt, by_recipe = plans
    plan = by_recipe[recipe]
    scales = build_input_scales(ckpt)
    # The shard with the most modules: routed experts, NVFP4 partners, kept tensors.
    shard = max(plan.shards, key=lambda s: len(s.modules))
    assert len(shard.modules) > 20
    (tmp_path / "seq").mkdir()
    reference = _sequential(tmp_path / "seq", plan, shard, scales)
    for label, transfer in (("piped", None), ("staged", DeviceTransfer(CPU, stage_host=True))):
        (tmp_path / label).mkdir()
        stats = run_shard_job(str(tmp_path / label), shard, _partners(plan, shard), scales, transfer=transfer)
        assert (tmp_path / label / shard.name).read_bytes() == reference, label
        assert stats["bytes"] == len(reference)


def test_without_kernel_copies_the_shard_is_the_same(plans, tmp_path, monkeypatch):
    """The page-cache writer (file systems without O_DIRECT) writes what the direct writer writes, and
    where copy_file_range cannot copy between the files (another filesystem, overlayfs, an old kernel)
    it falls back to a buffer, once per tensor, and still writes the same bytes."""
    import errno
    import os

    ckpt, by_recipe = plans
    plan = by_recipe["nvfp4"]
    scales = build_input_scales(ckpt)
    shard = max(plan.shards, key=lambda s: len(s.modules))
    (tmp_path / "seq").mkdir()
    reference = _sequential(tmp_path / "seq", plan, shard, scales)
    monkeypatch.setattr(shard_writer, "DIRECT_IO", False)
    (tmp_path / "page-cache").mkdir()
    run_shard_job(str(tmp_path / "page-cache"), shard, _partners(plan, shard), scales)
    assert (tmp_path / "page-cache" / shard.name).read_bytes() == reference
    refused = []

    def cross_device(*args):
        refused.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    (tmp_path / "fallback").mkdir()
    run_shard_job(str(tmp_path / "fallback"), shard, _partners(plan, shard), scales)
    assert (tmp_path / "fallback" / shard.name).read_bytes() == reference
    copied = sum(isinstance(t, SourceBytes) for m in shard.modules
                 for _, t in convert_module(m, ModuleContext(partner_sources=_partners(plan, shard).get(m.module, {}),
                                                             input_scale=scales)).tensors)
    assert copied > 20 and len(refused) == copied


def test_staging_copies_cpu_outputs_and_leaves_them_equal():
    source = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(2, 2, dtype=torch.bfloat16))]
    staged, ready = DeviceTransfer(CPU, stage_host=True).to_host(source)
    assert ready is None
    for (name, got), (want_name, want) in zip(staged, source):
        assert name == want_name and torch.equal(got, want) and got.data_ptr() != want.data_ptr()
    passed, _ = DeviceTransfer(CPU).to_host(source)
    assert all(got is want for (_, got), (_, want) in zip(passed, source))


class RecordingTransfer(DeviceTransfer):
    """Logs when each module is read relative to how many have been handed to the writer.

    With ``hold_until_read``, the first converted module is not handed over until that many modules
    have been read: the reader then gets as far ahead as the pipeline lets it, whatever the threads'
    relative speed on a busy machine.
    """

    def __init__(self, fail_at: str | None = None, hold_until_read: int | None = None):
        super().__init__(CPU)
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.fail_at = fail_at
        self.hold_until_read = hold_until_read
        self.read_enough = threading.Event()

    def read(self, job, ctx):
        if job.module == self.fail_at:
            raise CheckpointError("disk went away", tensor=job.module)
        with self.lock:
            self.events.append(("read", job.module))
            if self.hold_until_read and sum(kind == "read" for kind, _ in self.events) >= self.hold_until_read:
                self.read_enough.set()
        return super().read(job, ctx)

    def to_host(self, tensors):
        if self.hold_until_read and not any(kind == "convert" for kind, _ in self.events):
            # A bound on a hang only: a reader the pipeline lets run ahead gets there at once.
            assert self.read_enough.wait(timeout=120), f"the reader never read {self.hold_until_read} modules ahead"
        with self.lock:
            self.events.append(("convert", tensors[0][0].rsplit(".", 1)[0]))
        return super().to_host(tensors)


@pytest.mark.parametrize("queue_bytes", [0, 200_000])
def test_reads_run_in_plan_order_within_the_read_ahead_bound(plans, tmp_path, monkeypatch, queue_bytes):
    ckpt, by_recipe = plans
    plan = by_recipe["nvfp4"]
    shard = max(plan.shards, key=lambda s: len(s.modules))
    monkeypatch.setattr(pipeline, "QUEUE_BYTES", queue_bytes)
    threads = pipeline.CONVERT_THREADS
    # With a queue, hold the first hand-over until the reader is past the converters: it must get there.
    transfer = RecordingTransfer(hold_until_read=threads + 2 if queue_bytes else None)
    run_shard_job(str(tmp_path), shard, _partners(plan, shard), build_input_scales(ckpt), transfer=transfer)
    reads = [m for kind, m in transfer.events if kind == "read"]
    assert reads == [m.module for m in shard.modules]
    size = {m.module: sum(e.nbytes for e in m.sources.values()) for m in shard.modules}
    converted, ahead, most_ahead = 0, [], 0
    for kind, module in transfer.events:
        if kind == "read":
            ahead.append(size[module])
            # Beyond the modules being converted, at most one module or queue_bytes are read ahead.
            assert len(ahead) <= threads + 1 or sum(ahead[threads:]) <= queue_bytes
            most_ahead = max(most_ahead, len(ahead))
        else:
            converted += 1
            ahead.pop(0)
    assert converted == len(shard.modules)
    assert (most_ahead <= threads + 1) == (queue_bytes == 0)  # the queue is used when allowed


def test_a_failing_write_stops_the_job_and_leaves_no_file(plans, tmp_path, monkeypatch):
    ckpt, by_recipe = plans
    plan = by_recipe["fp8"]
    shard = max(plan.shards, key=lambda s: len(s.modules))
    bad = shard.planned[len(shard.planned) // 2].name
    real_write = ShardWriter.write

    def write(self, name, tensor):
        if name == bad:
            self.abort()
            raise CheckpointError("disk full", file=self.path, tensor=name)
        real_write(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", write)
    with pytest.raises(CheckpointError, match="disk full"):
        run_shard_job(str(tmp_path), shard, _partners(plan, shard), build_input_scales(ckpt))
    assert list(tmp_path.iterdir()) == []


def test_a_failing_read_stops_the_job_and_leaves_no_file(plans, tmp_path):
    ckpt, by_recipe = plans
    plan = by_recipe["nvfp4"]
    shard = max(plan.shards, key=lambda s: len(s.modules))
    bad = shard.modules[len(shard.modules) // 2].module
    with pytest.raises(CheckpointError, match="disk went away"):
        run_shard_job(str(tmp_path), shard, _partners(plan, shard), build_input_scales(ckpt),
                      transfer=RecordingTransfer(fail_at=bad))
    assert list(tmp_path.iterdir()) == []


def test_mxfp4_partner_reads_only_its_scale(plans):
    ckpt, by_recipe = plans
    plan = by_recipe["nvfp4"]
    job = next(m for m in plan.modules.values() if m.partner)
    partner_sources = plan.modules[job.partner].sources
    assert set(partner_params(job, partner_sources)) == {"scale"}
    read: list[str] = []

    def counting_read(entry):
        read.append(entry.name)
        return ckpt.read(entry.name)

    inputs = read_module(job, ModuleContext(read=counting_read, partner_sources=partner_sources))
    assert set(inputs.partner) == {"scale"}
    assert f"{job.partner}.weight" not in read and f"{job.partner}.scale" in read
    # Its own codes are not read either: NVFP4 keeps them, and the writer copies them file to file.
    assert f"{job.module}.weight" not in read and set(inputs.sources) == {"scale"}


def test_nvfp4_reads_only_the_codes_of_blocks_outside_the_window(plans, monkeypatch):
    """The codes are copied unread, except the few blocks whose exponent leaves E4M3's window:
    synth stores one all-zero block per expert as DeepSeek does (exponent -126), and another
    block pushed 30 binades down is inexact; the report must equal the full transcode's."""
    from dsv4convert.convert import modules

    ckpt, by_recipe = plans
    plan = by_recipe["nvfp4"]
    job = next(m for m in plan.modules.values() if m.partner)
    read, pieces = [], []

    def counting_read(entry):
        read.append(entry.name)
        return ckpt.read(entry.name)

    def counting_pieces(entry, offsets, size):
        pieces.append((entry.name, len(offsets)))
        return read_pieces(entry, offsets, size)

    monkeypatch.setattr(modules, "read_pieces", counting_pieces)
    ctx = ModuleContext(read=counting_read, partner_sources=plan.modules[job.partner].sources,
                        input_scale=build_input_scales(ckpt))
    packed, partner_scale = ckpt.read(f"{job.module}.weight"), ckpt.read(f"{job.partner}.scale")
    scale = ckpt.read(f"{job.module}.scale").view(torch.uint8).clone()
    for label, shift in (("synth", 0), ("one block 30 binades down", 30)):
        scale[0, 1] -= shift
        e8m0 = scale.view(torch.float8_e8m0fnu)
        read.clear(), pieces.clear()
        result = convert_module(job, ctx, ModuleInputs({"scale": e8m0}, {"scale": partner_scale}))
        weight = dict(result.tensors)[f"{job.module}.weight"]
        assert isinstance(weight, SourceBytes) and weight.entry == job.sources["weight"] and weight.dtype == "U8"
        _, want = mxfp4_to_nvfp4(packed, e8m0, global_exponent=nvfp4_global_exponent(e8m0, partner_scale))
        assert result.report == want, label
        assert read == [] and pieces == [(f"{job.module}.weight", 1 if shift == 0 else 2)], label
    assert not want.exact and want.blocks_total - want.blocks_exact == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_kept_tensors_are_checked_piece_by_piece_and_copied_unread(tmp_path, monkeypatch, dtype):
    """A kept tensor streams through one small reused buffer for its NaN check (no tensor-sized
    read), then goes out as SourceBytes; a NaN in any piece, or a short file, names the tensor."""
    from conftest import write_plain_checkpoint

    from dsv4convert.convert import modules

    monkeypatch.setattr(modules, "_SCAN_BYTES", 64)  # pieces of 64 bytes: many per tensor
    values = torch.randn(1000).to(dtype)
    bad = values.clone()
    bad.view(torch.uint8)[-values.element_size():] = 0x7F if dtype == torch.float8_e4m3fn else 0xFF  # NaN last
    root = write_plain_checkpoint(tmp_path / "src", [{"good": values, "bad": bad}])
    ckpt = Checkpoint.open(root)
    modules.check_source_finite(ckpt.entry("good"))
    with pytest.raises(DSV4Error, match=r"tensor 'bad'.*NaN or Inf"):
        modules.check_source_finite(ckpt.entry("bad"))
    entry = ckpt.entry("good")
    with open(entry.path, "r+b") as f:
        f.truncate(entry.start + entry.nbytes - 1)
    with pytest.raises(CheckpointError, match=rf"{entry.path.name}: tensor 'good': file ends after"):
        modules.check_source_finite(entry)


def test_kept_modules_go_out_as_source_bytes_without_a_tensor_read(plans):
    ckpt, by_recipe = plans
    read: list[str] = []
    ctx = ModuleContext(read=lambda entry: read.append(entry.name) or ckpt.read(entry.name))
    kept = [m for m in by_recipe["nvfp4"].modules.values() if not m.converts]
    assert len(kept) > 10
    for job in kept:
        result = convert_module(job, ctx)
        assert [(n, t.entry) for n, t in result.tensors] == [(e.name, e) for e in job.sources.values()]
        assert all(isinstance(t, SourceBytes) and (t.dtype, t.shape) == (t.entry.dtype, t.entry.shape)
                   for _, t in result.tensors)
    assert read == []


def test_device_is_checked_before_any_work(tiny_ckpt, tmp_path, capsys):
    assert resolve_device("cpu") == CPU
    for bad in ("tpu", "not a device"):
        with pytest.raises(DSV4Error, match="device"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(DSV4Error, match="no CUDA GPU"):
            resolve_device("cuda")
        assert main(["to-nvfp4", "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"), "--device", "cuda",
                     "--no-progress"]) == 2
        assert "no CUDA GPU" in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


def test_pipeline_memory_counts_the_modules_in_flight(plans):
    _, by_recipe = plans
    for plan in by_recipe.values():
        for shard in plan.shards:
            largest = max(sum(e.nbytes for e in m.sources.values()) + sum(p.nbytes for p in m.outputs)
                          for m in shard.modules)
            assert pipeline_memory(shard) == (shard.memory_estimate + pipeline.CONVERT_THREADS * largest
                                              + 2 * pipeline.QUEUE_BYTES + pipeline.WRITER_MEMORY)


def test_realistic_mxfp4_is_deterministic_and_shaped_like_deepseeks_quantizer():
    packed, scale = realistic_mxfp4(256, 512, torch.Generator().manual_seed(3))
    again, again_scale = realistic_mxfp4(256, 512, torch.Generator().manual_seed(3))
    other, _ = realistic_mxfp4(256, 512, torch.Generator().manual_seed(4))
    assert torch.equal(packed, again) and torch.equal(scale.view(torch.uint8), again_scale.view(torch.uint8))
    assert not torch.equal(packed, other)
    assert packed.dtype == torch.int8 and packed.shape == (256, 256)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (256, 16)
    # DeepSeek's ceil(log2(amax / 6)) puts every non-zero block's largest magnitude in (3, 6].
    w = dequantize_mxfp4(packed, scale).reshape(256, 16, 32)
    peak = w.abs().amax(-1) / torch.exp2(scale.view(torch.uint8).float() - 127)
    live = peak > 0
    assert int((~live).sum()) == 1, "exactly one all-zero block"
    assert bool(((peak[live] >= 3) & (peak[live] <= 6)).all())
    assert int(scale.view(torch.uint8)[~live]) == 1, "zero blocks carry DeepSeek's exponent -126"
    assert len(scale.view(torch.uint8)[live].unique()) >= 6
    # Real experts cast to FP8 and NVFP4 without loss; so must these.
    assert mxfp4_to_fp8_block(packed, scale, block=(128, 128))[2].exact
    assert mxfp4_to_nvfp4(packed, scale)[1].exact


def test_spawned_workers_get_a_passive_openmp_wait_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    pipeline.quiet_openmp_for_workers()
    assert pipeline.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    pipeline.quiet_openmp_for_workers()
    assert pipeline.os.environ["OMP_WAIT_POLICY"] == "ACTIVE", "a user's choice is kept"


@pytest.mark.parametrize("cores, workers, threads", [(2, 1, 1), (16, 1, 8), (16, 4, 2), (4, 8, 1), (None, 1, 1)])
def test_torch_threads_leave_one_core_per_converter_thread(monkeypatch, cores, workers, threads):
    monkeypatch.setattr(pipeline, "CONVERT_THREADS", 2)
    monkeypatch.setattr(pipeline.os, "cpu_count", lambda: cores)
    assert pipeline.intra_op_threads(workers) == threads


def test_one_worker_converts_with_those_threads_and_gives_the_old_count_back(tiny_ckpt, tmp_path, monkeypatch):
    seen = []
    real_job = execute.run_shard_job
    monkeypatch.setattr(execute, "run_shard_job", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                                   real_job(*a, **k))[1])
    monkeypatch.setattr(execute, "intra_op_threads", lambda workers: 1)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        assert main(["to-nvfp4", "--src", str(tiny_ckpt), "--dst", str(tmp_path / "o"), "--no-progress"]) == 0
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("ahead", [0, 1 << 20])
def test_reads_ask_the_kernel_for_what_follows_once_each(plans, tmp_path, monkeypatch, ahead):
    ckpt, by_recipe = plans
    plan = by_recipe["nvfp4"]
    shard = max(plan.shards, key=lambda s: len(s.modules))
    hints = []
    monkeypatch.setattr(pipeline, "PREFETCH_BYTES", ahead)
    monkeypatch.setattr(pipeline, "prefetch", lambda entries: hints.append([e.name for e in entries]))
    run_shard_job(str(tmp_path), shard, _partners(plan, shard), build_input_scales(ckpt))
    following = [[e.name for e in m.sources.values()] for m in shard.modules[1:]]
    assert sum(hints, []) == sum(following, [])  # everything after the first module, once, in order
    if ahead == 0:
        assert hints == following  # at least the next module, one at a time
    else:
        assert len(hints) < len(following)  # a window of modules per hint


def test_prefetch_is_only_a_hint(plans, tmp_path):
    ckpt, _ = plans
    entries = [e for header in ckpt.headers.values() for e in header.entries.values()][:5]
    prefetch(entries)  # real files: no effect on what is read
    assert [torch.equal(read_tensor(e), read_tensor(e)) for e in entries] == [True] * 5
    gone = dataclasses.replace(entries[0], path=tmp_path / "missing.safetensors")
    prefetch([gone])  # a missing file is left for the real read to report


def test_page_cache_writer_hands_written_bytes_to_writeback_as_it_goes(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_writer, "DIRECT_IO", False)
    calls = []
    monkeypatch.setattr(shard_writer, "_WRITEBACK_EVERY", 1000)
    monkeypatch.setattr(shard_writer, "_WRITE_CHUNK", 300)
    monkeypatch.setattr(shard_writer.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((off, n, advice)))
    tensors = [(f"t{i}", torch.arange(i * 100, i * 100 + 400, dtype=torch.int32)) for i in range(4)]  # 1600 B each
    planned = [PlannedTensor(name, "I32", (400,)) for name, _ in tensors]
    with ShardWriter(tmp_path / "s.safetensors", planned) as writer:
        for name, t in tensors:
            writer.write(name, t)
    assert calls and all(advice == shard_writer.os.POSIX_FADV_DONTNEED for _, _, advice in calls)
    assert [off for off, _, _ in calls] == [0] + [off + n for off, n, _ in calls[:-1]]  # contiguous from 0
    assert all(n >= 1000 for _, n, _ in calls)
    loaded = safetensors.torch.load_file(tmp_path / "s.safetensors")
    assert all(torch.equal(loaded[name], t) for name, t in tensors)
