"""Named points a conversion passes, where a crash test can stop it exactly.

The crash-torture tests (``tests/test_reliability_torture.py``, ``bench/torture.py``) must
SIGKILL, SIGTERM or Ctrl-C a conversion at a known moment whatever the machine's speed, so
every phase boundary calls :func:`reach` with the point's name ("lock: linking",
"model-00003-of-00013.safetensors: writing tensor 7 of 40", ...). In a normal run that is
one test of a module global and nothing else: no command-line flag sets it.

A test arms it through the environment (``DSV4_STOP_POINTS``, JSON) or :func:`install`
(a process forked from an already-imported server):

* ``{"log": PATH}`` appends ``<pid> <thread> <point>`` for every point passed: the trace of
  an uninterrupted run, from which a test picks its points;
* ``{"at": NAME, "occurrence": N, "notify": FIFO, "release": FIFO}``: the thread that reaches
  ``NAME`` for the N-th time writes ``<pid> <point>`` to ``notify`` and blocks reading one byte
  from ``release``. The test then kills, signals (a handler raising in the main thread
  interrupts the read) or releases the process. The test holds both FIFOs open read-write,
  so neither side's ``open`` ever blocks.
"""

from __future__ import annotations

import json
import os
import threading

ENV = "DSV4_STOP_POINTS"


class _Armed:
    def __init__(self, spec: dict):
        self.log = spec.get("log")
        self.at = spec.get("at")
        self.occurrence = int(spec.get("occurrence", 1))
        self.notify = spec.get("notify")
        self.release = spec.get("release")
        self.seen = 0
        self.lock = threading.Lock()

    def reach(self, point: str) -> None:
        if self.log:
            line = f"{os.getpid()} {threading.current_thread().name} {point}\n"
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        if point != self.at:
            return
        with self.lock:
            self.seen += 1
            if self.seen != self.occurrence:
                return
        fd = os.open(self.notify, os.O_WRONLY)
        try:
            os.write(fd, f"{os.getpid()} {point}\n".encode())
        finally:
            os.close(fd)
        fd = os.open(self.release, os.O_RDONLY)
        try:
            os.read(fd, 1)
        finally:
            os.close(fd)


def install(spec: dict | None) -> None:
    """Arm (or, with None, disarm) the stop points of this process."""
    global _armed
    _armed = _Armed(spec) if spec else None


def reach(point: str) -> None:
    """This process is at ``point``: log it, or stop here when a test asked to."""
    if _armed is not None:
        _armed.reach(point)


_armed: _Armed | None = None
install(json.loads(os.environ[ENV]) if os.environ.get(ENV) else None)
