"""One output shard's pipeline: read ahead, convert, write behind, on the CPU or a GPU.

Reading, converting and writing overlap (:class:`ShardPipeline`): a reader thread reads and checks
the next module while ``CONVERT_THREADS`` modules convert, and a writer thread streams earlier
modules' tensors to disk. Order is fixed, so the bytes are those of a sequential run, and the
queues between the stages are bounded in bytes (:func:`pipeline_memory` is the job's peak). With a
GPU, tensors bound for it are read into pinned memory, converted there, and copied back into pinned
buffers that the writer drains after an event (:class:`DeviceTransfer`).
"""

from __future__ import annotations

import gc
import os
import queue
import signal
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from dsv4convert.calibration import CalibrationHessians, InputScales
from dsv4convert.checkpoint import WRITER_MEMORY, ShardWriter, SourceBytes, prefetch, read_tensor
from dsv4convert.convert.modules import ModuleContext, ModuleInputs, ModuleResult, convert_module, read_module
from dsv4convert.convert.plan import ModuleJob, ShardJob
from dsv4convert.devices import resolve_device
from dsv4convert.models.deepseek_v4.layout import Role
from dsv4convert.stop_points import reach


class DeviceTransfer:
    """Moves a module's outputs back to the host for writing.

    For a GPU the copies go into pinned buffers without blocking, and the writer waits on
    an event before touching them. ``stage_host`` makes CPU outputs take the same staging
    copy, so the GPU plumbing can be checked bit for bit on a machine without one.
    """

    def __init__(self, device: torch.device, *, stage_host: bool = False):
        self.device = device
        self.stage_host = stage_host

    def read(self, job: ModuleJob, ctx: ModuleContext) -> ModuleInputs:
        return read_module(job, ctx)

    def to_host(self, tensors: list[tuple[str, torch.Tensor | SourceBytes]]
                ) -> tuple[list[tuple[str, torch.Tensor | SourceBytes]], object]:
        """Host copies of ``tensors`` and what to wait on before reading them (None: nothing).

        Bytes copied file to file (:class:`SourceBytes`) pass as they are.
        """
        staged, on_gpu = [], False
        for name, t in tensors:
            if isinstance(t, SourceBytes):
                host = t
            elif t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                on_gpu = True
            elif self.stage_host:
                host = torch.empty_like(t).copy_(t)
            else:
                host = t
            staged.append((name, host))
        if not on_gpu:
            return staged, None
        event = torch.cuda.Event()
        event.record()
        return staged, event


# How far ahead of the module being read the kernel is asked to fetch source bytes.
PREFETCH_BYTES = 256 * 1024 * 1024
# Modules read ahead of the converter, and converted modules waiting for the writer, may each
# hold this many bytes beyond the one module always allowed: the queues absorb the disk's
# stalls (a throttled write, a slow read) so the converter keeps working through them.
QUEUE_BYTES = 128 * 1024 * 1024
# Modules converted at once: a second thread keeps both cores busy where one module's conversion,
# not the disk, is the slowest stage (MXFP4 -> FP8 on a 2-core machine).
CONVERT_THREADS = 2


class ShardPipeline:
    """Read ahead, convert, write behind, in plan order, with byte-bounded queues between them."""

    def __init__(self, job: ShardJob, partners: dict[str, dict], input_scales: InputScales | None,
                 transfer: DeviceTransfer, hessians: CalibrationHessians | None = None):
        self.job = job
        self.partners = partners
        self.input_scales = input_scales
        self.hessians = hessians
        self.transfer = transfer
        self.pinned_read = partial(read_tensor, pin_memory=True)
        self._hinted = 0  # modules [0, _hinted) have been handed to prefetch

    def context(self, module: ModuleJob) -> ModuleContext:
        # Only tensors bound for the GPU are read into (cached, scarce) pinned memory.
        to_gpu = self.transfer.device.type == "cuda" and module.converts
        return ModuleContext(read=self.pinned_read if to_gpu else read_tensor,
                             partner_sources=self.partners.get(module.module, {}),
                             input_scale=self.input_scales, device=self.transfer.device, hessian=self.hessians)

    def run(self, writer: ShardWriter, on_module: Callable[[ModuleJob, ModuleResult], None]) -> None:
        modules = self.job.modules
        device = self.transfer.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        reads: deque[tuple[int, Future]] = deque()   # (bytes, read) of modules not yet converting
        converting: deque[tuple[ModuleJob, Future]] = deque()
        writes: deque[tuple[int, Future]] = deque()  # (bytes, write) of modules not yet written
        on_gpu = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
        with ThreadPoolExecutor(1, thread_name_prefix="read") as reader, \
                ThreadPoolExecutor(CONVERT_THREADS, "convert", *on_gpu) as converter, \
                ThreadPoolExecutor(1, thread_name_prefix="write") as writer_thread:
            submitted = 0

            def read_ahead() -> None:
                nonlocal submitted
                while submitted < len(modules) and (
                        not reads or sum(b for b, _ in reads) + modules[submitted].bytes_in <= QUEUE_BYTES):
                    reads.append((modules[submitted].bytes_in, reader.submit(self._read, submitted)))
                    submitted += 1

            def write_behind(module: ModuleJob, result: ModuleResult) -> None:
                staged, ready = self.transfer.to_host(result.tensors)
                result.tensors = []
                nbytes = sum(t.numel() * t.element_size() for _, t in staged if isinstance(t, torch.Tensor))
                writes.append((nbytes, writer_thread.submit(self._write, writer, staged, ready)))
                del staged
                # Surface a failed write at once; wait only while the queue is over its bound.
                while writes and (writes[0][1].done() or sum(b for b, _ in writes) - nbytes > QUEUE_BYTES):
                    writes.popleft()[1].result()
                on_module(module, result)

            try:
                for position, module in enumerate(modules):
                    read_ahead()
                    inputs = reads.popleft()[1].result()
                    read_ahead()
                    converting.append((module, converter.submit(self._convert, position, inputs)))
                    del inputs
                    # Results are written in plan order; wait for the oldest once every thread is busy.
                    while converting and (len(converting) >= CONVERT_THREADS or converting[0][1].done()):
                        oldest, conversion = converting.popleft()
                        write_behind(oldest, conversion.result())
                while converting:
                    oldest, conversion = converting.popleft()
                    write_behind(oldest, conversion.result())
                while writes:
                    writes.popleft()[1].result()
            finally:
                # On an error, let the threads finish what they hold before the writer is aborted.
                for fut in (*(f for _, f in reads), *(f for _, f in converting), *(f for _, f in writes)):
                    fut.cancel()
                    wait([fut])

    def _convert(self, position: int, inputs: ModuleInputs) -> ModuleResult:
        module = self.job.modules[position]
        reach(f"{self.job.name}: converting module {position + 1} of {len(self.job.modules)}")
        return convert_module(module, self.context(module), inputs)

    def _read(self, index: int) -> ModuleInputs:
        """Read module ``index``, having asked the kernel to fetch what follows it meanwhile.

        The hint covers the next ``PREFETCH_BYTES`` of sources (at least the next module), so
        the disk keeps a deep queue even while a run of small expert modules is read.
        """
        modules = self.job.modules
        self._hinted = max(self._hinted, index + 1)
        ahead = sum(m.bytes_in for m in modules[index + 1:self._hinted])
        hint = []
        while self._hinted < len(modules) and (ahead < PREFETCH_BYTES or self._hinted == index + 1):
            hint += modules[self._hinted].sources.values()
            ahead += modules[self._hinted].bytes_in
            self._hinted += 1
        if hint:
            prefetch(hint)
        module = modules[index]
        return self.transfer.read(module, self.context(module))

    @staticmethod
    def _write(writer: ShardWriter, staged: list[tuple[str, torch.Tensor | SourceBytes]], ready: object) -> None:
        if ready is not None:
            ready.synchronize()
        for name, tensor in staged:
            writer.write(name, tensor)


class BarFeed:
    """In one process the bar advances module by module, as the queue of worker processes would."""

    def __init__(self, bar: tqdm):
        self.put = bar.update


def run_shard_job(dst: str, job: ShardJob, partners: dict[str, dict], input_scales: InputScales | None,
                  progress: "queue.Queue | BarFeed | None" = None, device: str = "cpu",
                  transfer: DeviceTransfer | None = None, hessians: CalibrationHessians | None = None) -> dict:
    """Convert and write one output shard; returns its stats (picklable, for the resume state)."""
    stats: dict = {"roles": defaultdict(lambda: defaultdict(int)), "input_scale_sources": defaultdict(int)}
    transfer = transfer or DeviceTransfer(resolve_device(device))

    def record(module: ModuleJob, result: ModuleResult) -> None:
        row = stats["roles"][_role_key(module.role, module.is_mtp)]
        row["converted" if module.converts else "kept"] += 1
        if result.report is not None:
            row["blocks_total"] += result.report.blocks_total
            row["blocks_exact"] += result.report.blocks_exact
            row["max_abs_error"] = max(row["max_abs_error"], result.report.max_abs_error)
        if result.input_scale_source:
            stats["input_scale_sources"][result.input_scale_source] += 1
        if progress is not None:
            progress.put(module.bytes_in)

    # The plan and the source index are ~10^5 long-lived objects: keep the cyclic GC from
    # re-walking them on every collection the shard's many small allocations trigger.
    gc.freeze()
    path = Path(dst) / job.name
    with ShardWriter(path, job.planned, metadata={"format": "pt"}) as writer:
        ShardPipeline(job, partners, input_scales, transfer, hessians).run(writer, record)
    return {"bytes": path.stat().st_size, "roles": {k: dict(v) for k, v in stats["roles"].items()},
            "input_scale_sources": dict(stats["input_scale_sources"])}


def pipeline_memory(shard: ShardJob) -> int:
    """Peak resident bytes of a job: its largest module in every converter thread, both full queues and
    the shard writer's staging chunks."""
    in_flight = max((m.bytes_in + sum(p.nbytes for p in m.outputs) for m in shard.modules), default=0)
    return shard.memory_estimate + CONVERT_THREADS * in_flight + 2 * QUEUE_BYTES + WRITER_MEMORY


def _role_key(role: Role, is_mtp: bool) -> str:
    return f"{role.value} (mtp)" if is_mtp and role is Role.ROUTED_EXPERT else role.value


# ------------------------------------------------------------------------------- driver side


def init_worker(threads: int) -> None:
    """A worker process: its torch threads, and Ctrl-C left to the parent (which decides how to stop)."""
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def intra_op_threads(workers: int) -> int:
    """Torch's threads in each of ``workers`` processes: the cores left once every pipeline runs
    CONVERT_THREADS modules at once. OpenMP teams on top of those threads oversubscribe the cores:
    on 2 cores a NaN check of the 1 GB embedding in 8 MB pieces took 1.17 s with 2 threads, 0.39 s with 1."""
    return max(1, (os.cpu_count() or 1) // (workers * CONVERT_THREADS))


def quiet_openmp_for_workers() -> None:
    """Spawned workers inherit ``OMP_WAIT_POLICY=PASSIVE`` unless the user set a policy.

    OpenMP threads that spin while waiting take cores from the reader and writer threads
    and from the other workers; on a loaded 2-core machine that made scale-only transcodes
    10x slower. It must be in the environment before a process loads torch, so it can only
    be given to the workers this process spawns.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
