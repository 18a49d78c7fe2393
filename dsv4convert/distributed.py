"""Several GPUs or hosts for ``calibrate`` and ``compare``: the ranks torchrun starts, and how they combine.

The work is data-parallel: every rank streams the same blocks (read from the same path, so on one
host the page cache serves them once) and runs its own share of the micro-batches, assigned round
robin (:meth:`World.owns`). Results combine on rank 0 in the global micro-batch order, so they do not
depend on the number of ranks: maxima, counts and anything rank 0 sums in that order come out
bit-identical to a run of one rank; only sums reduced across ranks by the backend (calibration's
Hessians) carry float rounding. Rank 0 writes every output file.

``torchrun --nproc-per-node N [--nnodes M --rdzv-endpoint HOST:PORT] -m dsv4convert calibrate|compare ...``
starts the ranks (NCCL on GPUs, gloo on CPUs); ``--gpus 0,1,2,3`` does the same on one host through
torch's own launcher (:func:`launch_local`), which also stops every rank when one dies. A collective
waits at most ``TIMEOUT_SECONDS`` for a rank that is gone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dsv4convert.devices import resolve_device
from dsv4convert.errors import DSV4Error

TIMEOUT_SECONDS = 600.0   # a lost rank's collective fails after this, whatever the launcher


@dataclass(frozen=True)
class World:
    """This process's place among the ranks (a world of one without torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Whether micro-batch ``index`` (in the global order) is this rank's."""
        return index % self.size == self.rank

    def device(self, requested: str) -> torch.device:
        """``cuda`` becomes this rank's local GPU; anything else stays as asked."""
        device = torch.device(requested)
        if self.size > 1 and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", self.local_rank)
        return device

    def gather(self, obj: object) -> list | None:
        """Every rank's ``obj`` on rank 0, in rank order (None elsewhere)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.is_main else None
        dist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """In place on every rank: ``"max"`` (exact) or ``"sum"`` (float sums carry the backend's order)."""
        if self.size > 1:
            dist.all_reduce(tensor, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op])
        return tensor

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def describe(self, tokens_per_rank: list[int]) -> dict:
        """Provenance: how the work was split."""
        return {"world_size": self.size, "backend": self.backend, "tokens_per_rank": tokens_per_rank}


def join(device: str) -> World:
    """The world torchrun started this process in (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), joined with NCCL
    for a GPU and gloo for the CPU; a world of one when there is none."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = resolve_device(device).type == "cuda"
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise DSV4Error(f"rank {rank}: local rank {local_rank} but this host has {torch.cuda.device_count()} GPU(s)")
        torch.cuda.set_device(local_rank)
    backend = "nccl" if cuda else "gloo"
    if not dist.is_initialized():
        _bind_world_defaults_before_init()
        dist.init_process_group(backend, timeout=timedelta(seconds=TIMEOUT_SECONDS))
    return World(rank, size, local_rank, backend)


def _bind_world_defaults_before_init() -> None:
    """Import ``torch.distributed.nn.functional`` while there is no world group yet.

    Its functions take ``group=group.WORLD`` as a default argument, bound when the module is imported. transformers
    imports it (through its FSDP integration) when a command first loads a model, after :func:`join`; the module
    then holds the world group for the life of the interpreter, :func:`leave` cannot free it, and gloo's worker
    threads outlive ``destroy_process_group``. They release their last work during interpreter shutdown, which
    takes the GIL from a finalizing interpreter and aborts the rank ("terminate called without an active
    exception"): a rare crash at the end of a run that succeeded. Imported first, the defaults bind ``None``.
    """
    import torch.distributed.nn.functional  # noqa: F401


def leave(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def run_as_rank(args, command: Callable[[World], int], *, launch: bool = True) -> int:
    """A command (``calibrate``, ``compare``) on this process's rank: with ``--gpus`` and no world yet, first
    start one rank per listed GPU (:func:`launch_local`); otherwise join torchrun's world, if any."""
    if args.gpus and int(os.environ.get("WORLD_SIZE", "1")) <= 1 and launch:
        return launch_local(args.gpus, strip_gpus(args.argv))
    world = join(args.device)
    try:
        return command(world)
    finally:
        leave(world)


def launch_local(gpus: str, argv: list[str]) -> int:
    """``--gpus 0,1,2,3``: the same command as one rank per listed GPU on this host, through torch's own
    launcher (``torch.distributed.run``, what ``torchrun`` is); a rank that dies stops the others, and the
    error names it in one line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    devices = [g.strip() for g in gpus.split(",") if g.strip()]
    if not devices or not all(g.isdigit() for g in devices):
        raise DSV4Error(f"--gpus must list GPU indices like 0,1,2,3, got {gpus!r}")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(len(devices)),
                                         "-m", "dsv4convert", *argv])
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()   # the earliest: the others are usually the launcher's stop
        how = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
        raise DSV4Error(f"rank {rank} (pid {failure.pid}) ended with {how}, and the launcher stopped the other "
                        "ranks; nothing was written under a final name. Run the same command again to resume") from None
    return 0


def strip_gpus(argv: list[str]) -> list[str]:
    """``argv`` without ``--gpus X`` / ``--gpus=X`` (what each rank runs)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--gpus":
            skip = True
            continue
        if arg.startswith("--gpus="):
            continue
        out.append(arg)
    return out
