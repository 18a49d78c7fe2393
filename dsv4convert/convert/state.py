"""Resume state and the destination lock of a conversion.

``DST/.dsv4convert/state.json`` records the run's signature (a hash of the source's
tensor table and config, the recipe and every option that changes the bytes written)
and each finished shard with its size and stats. It is rewritten atomically after each
shard, so after a crash it lists exactly the shards whose final files are complete. A
resume with a different signature is refused. ``DST/.dsv4convert/lock`` holds the pid
and host of the running conversion; a second run is refused while that process lives,
and a lock left by a dead process is taken over with a warning. So is a lock file without a
readable holder once it is older than LOCK_WRITE_GRACE: the holder is written right after
the file is created, so such a lock was left by a run killed in between.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dsv4convert import __version__
from dsv4convert.checkpoint import Checkpoint, atomic_write_json
from dsv4convert.checkpoint.reader import CONVERSION_STATE, WORK_DIR
from dsv4convert.errors import DSV4Error
from dsv4convert.stop_points import reach

# Seconds after which a lock file with no readable holder counts as left by a killed run.
LOCK_WRITE_GRACE = 10.0


def signature(ckpt: Checkpoint, recipe_canonical: str, options: dict) -> str:
    h = hashlib.sha256()
    h.update(f"dsv4convert {__version__}\n".encode())
    h.update(json.dumps(ckpt.config, sort_keys=True).encode())
    for name, e in ckpt.tensors.items():
        h.update(f"{name}|{e.dtype}|{list(e.shape)}|{e.path.name}|{e.nbytes}\n".encode())
    h.update(recipe_canonical.encode())
    h.update(json.dumps(options, sort_keys=True, default=str).encode())
    return h.hexdigest()


@dataclass
class RunState:
    path: Path
    signature: str
    started: str
    shards: dict[str, dict] = field(default_factory=dict)
    complete: bool = False

    @classmethod
    def load(cls, dst: Path) -> "RunState | None":
        path = Path(dst) / CONVERSION_STATE
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(path, data["signature"], data["started"], data.get("shards", {}), data.get("complete", False))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DSV4Error(f"resume state is unreadable ({exc}); start over with --overwrite", file=path) from None

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        done = f"{len(self.shards)} shards{', complete' if self.complete else ''}"
        atomic_write_json(self.path, {"signature": self.signature, "started": self.started,
                                      "shards": self.shards, "complete": self.complete},
                          point=f"resume state ({done})")

    def done(self, dst: Path, shard: str) -> bool:
        """Whether ``shard`` was finished by this run: recorded here, and its file in ``dst`` of the recorded size."""
        record = self.shards.get(shard)
        path = Path(dst) / shard
        return bool(record) and path.exists() and path.stat().st_size == record["bytes"]


def prepare_destination(dst: Path, sig: str, *, resume: bool, overwrite: bool, recipe_name: str) -> RunState:
    """The run state to write ``dst`` with: a new one (``dst`` created, emptied under ``overwrite``) or, under
    ``resume``, the interrupted run's with the same signature ``sig``; anything else is refused in one line."""
    state = RunState.load(dst) if dst.exists() else None
    # Our own state directory alone (a run killed before its first state save) is not user content;
    # the lock still refuses a live concurrent run.
    nonempty = dst.exists() and any(p.name != WORK_DIR for p in dst.iterdir())
    if overwrite and nonempty:
        DestinationLock(dst).acquire()  # refuse to wipe a directory another run is writing
        shutil.rmtree(dst)
        state = None
    elif nonempty and not resume:
        raise DSV4Error("destination is not empty; pass --resume to continue an interrupted conversion or "
                        "--overwrite to start over", file=dst)
    elif resume and state is not None and state.signature != sig and state.complete:
        raise DSV4Error(f"--resume refused: this directory holds a finished conversion{_made_with(dst)} from another "
                        f"source, recipe or options than this command's (recipe '{recipe_name}'), so there is "
                        "nothing to resume: give another --dst, or --overwrite to replace it", file=dst)
    elif resume and state is not None and state.signature != sig:
        raise DSV4Error("--resume refused: the source, recipe or options differ from the interrupted run "
                        "(use the same command, or --overwrite to start over)", file=dst)
    elif resume and state is None and nonempty:
        raise DSV4Error("--resume refused: this directory holds no dsv4convert run state", file=dst)
    reach("destination: creating it")
    dst.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = RunState(dst / CONVERSION_STATE, sig, datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return state


def _made_with(dst: Path) -> str:
    """' (recipe NAME)' of a finished conversion, from its provenance.json; '' where that cannot be read."""
    try:
        return f" (recipe '{json.loads((dst / 'provenance.json').read_text())['recipe']['name']}')"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class DestinationLock:
    """An exclusive, stale-aware lock on a destination directory."""

    def __init__(self, dst: Path):
        self.path = Path(dst) / WORK_DIR / "lock"
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        self._remove_dead_drafts()
        # The holder is written to a draft first and the lock appears by link(), which fails if it
        # exists: a lock file therefore always names its holder, even if we are killed midway.
        draft = self.path.with_name(f".lock.{os.getpid()}.partial")
        reach("lock: writing its draft")
        draft.write_text(json.dumps(me))
        try:
            for _ in range(2):
                try:
                    reach("lock: linking")
                    os.link(draft, self.path)
                except FileExistsError:
                    holder = self._holder()
                    if holder and holder.get("host") == me["host"] and isinstance(holder.get("pid"), int) \
                            and not _pid_alive(holder["pid"]):
                        print(f"warning: {self.path}: removing stale lock of dead process {holder['pid']}",
                              file=sys.stderr)
                        self.path.unlink(missing_ok=True)
                        continue
                    if holder is None and self._age() > LOCK_WRITE_GRACE:
                        print(f"warning: {self.path}: removing a lock with no holder recorded (left by an older "
                              "version killed while taking it)", file=sys.stderr)
                        self.path.unlink(missing_ok=True)
                        continue
                    who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "an unknown process"
                    raise DSV4Error(f"another conversion ({who}) is writing this destination; if it is gone, "
                                    f"delete {self.path}", file=self.path.parent.parent) from None
                self.held = True
                return
        finally:
            draft.unlink(missing_ok=True)
        raise DSV4Error("could not take the destination lock", file=self.path)

    def _remove_dead_drafts(self) -> None:
        for draft in self.path.parent.glob(".lock.*.partial"):
            pid = draft.name.split(".")[2]
            if pid.isdigit() and not _pid_alive(int(pid)):
                draft.unlink(missing_ok=True)

    def _holder(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return 0.0

    def release(self) -> None:
        if self.held:
            reach("lock: releasing")
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> "DestinationLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
