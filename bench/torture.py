"""Crash torture: stop real conversions at named points, kill them there, resume, compare every byte.

A conversion of the real model runs for an hour on machines that get preempted, so a kill
at any moment must leave a destination that ``--resume`` finishes into exactly the files an
uninterrupted run writes. The kills land by construction, whatever the machine's speed:

* the converter calls :func:`dsv4convert.stop_points.reach` at every phase boundary (reading
  the index and each header, creating the destination, taking the lock, opening, writing each
  tensor of and renaming each shard's ``.partial``, converting each module, every resume-state
  save, every file of the finalization, releasing the lock). An uninterrupted run logs the points
  it passes; the kill points are picked from that trace (:func:`catalogue`), on every phase;
* the conversion is started with one point armed; the thread that reaches it reports on a FIFO
  and blocks there; the harness then SIGKILLs the whole process group (or sends SIGTERM / Ctrl-C),
  so the kill lands exactly at the point. A run that ends without reaching its point is a failure
  that names the point, never a silently skipped case. No timer decides what is tested;
  "random" points are seeded picks among all the points of the trace, mid-shard ones included.

After each kill it checks that nothing under a final name is torn (every final-named file is
byte-identical to the reference, no index before all shards), snapshots the shards the resume
state lists as finished, resumes, and checks that the result is byte-identical to the
uninterrupted run (``provenance.json``/``state.json`` compared without their start time) and
that no finished shard was rewritten (bytes lost). SIGTERM and Ctrl-C (SIGINT to the group)
must stop with a one-line message naming ``--resume``, exit 2, and resume identically.

    python bench/torture.py                                   # small preset, fp8 + nvfp4
    python bench/torture.py --preset tiny --recipes nvfp4 --launcher fork --out /tmp/t.json

Results go to ``bench/results/torture-<preset>.json``; ``docs/reliability.md`` has the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import random
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from dsv4convert import stop_points  # noqa: E402  (standard library only: cheap in every child)

# Files whose JSON records the wall-clock start of the run; compared without that field.
TIMED_FILES = ("provenance.json", ".dsv4convert/state.json")
# Files that name the destination itself (the model card's launch commands); compared with it replaced.
PATH_FILES = ("README.md",)
SHARD_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
# A hang guard only: a stopped or finished run answers long before; nothing is decided by it.
STOP_WAIT_SECONDS = 600.0
# What a conversion imports when it runs (torch, the converter, the formats): loaded once in the fork server, so a
# forked run converts at once instead of spending about a second importing (1.3 s -> 0.4 s a run on the tiny model).
CONVERSION_MODULES = ("dsv4convert.convert.execute", "dsv4convert.convert.cli")

# --------------------------------------------------------------------------- launching conversions


@dataclasses.dataclass
class Run:
    """One conversion process (its own session, so a group kill reaches its workers)."""

    popen: subprocess.Popen | _Forked
    stdout: Path
    stderr: Path
    started: float

    def kill_group(self, sig: int = signal.SIGKILL) -> bool:
        """Signal the whole process group; False when the run had already exited."""
        if self.popen.poll() is not None:
            return False
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_group()
            self.popen.wait()
            raise RuntimeError(f"conversion did not finish within {timeout:.0f} s; stderr: {self.stderr.read_text()[-2000:]}")

    def output(self) -> tuple[str, str]:
        return tuple(p.read_text(errors="replace") if p.exists() else "" for p in (self.stdout, self.stderr))

    def exit_fd(self) -> int:
        """A descriptor that turns readable when the process exits (for ``select``)."""
        if isinstance(self.popen, _Forked):
            return self.popen.process.sentinel
        if not hasattr(self, "_pidfd"):
            self._pidfd = os.pidfd_open(self.popen.pid)
        return self._pidfd


class Launcher:
    """Starts ``python -m dsv4convert <argv>`` subprocesses, optionally with a stop point armed or limits."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.count = 0

    def start(self, argv: list[str], *, stop: dict | None = None, preexec: Callable[[], None] | None = None) -> Run:
        self.count += 1
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        env.pop(stop_points.ENV, None)
        if stop:
            env[stop_points.ENV] = json.dumps(stop)
        out, err = self.workdir / f"run{self.count}.out", self.workdir / f"run{self.count}.err"

        def prepare_child() -> None:
            # A shell starts background jobs with SIGINT ignored, and exec keeps that: give the
            # conversion Ctrl-C back, as in a terminal.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if preexec is not None:
                preexec()

        with open(out, "wb") as o, open(err, "wb") as e:
            popen = subprocess.Popen([sys.executable, "-m", "dsv4convert", *argv], cwd=REPO, env=env,
                                     stdout=o, stderr=e, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=prepare_child)
        return Run(popen, out, err, time.monotonic())

    def close(self) -> None:
        pass


class _Forked:
    """The ``subprocess.Popen`` calls Run needs, for a process forked by multiprocessing's fork server."""

    def __init__(self, process) -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return None if self.process.is_alive() else self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired("forked conversion", timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)


def _forked_main(argv: list[str], stop: dict | None, out: str, err: str) -> None:
    """Body of a forked conversion: what ``python -m dsv4convert`` does, minus interpreter start-up."""
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if stop:
        os.environ[stop_points.ENV] = json.dumps(stop)  # for the worker processes it spawns
    stop_points.install(stop)
    from dsv4convert.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkLauncher(Launcher):
    """Like Launcher, but forks each conversion from a server that has already imported torch and the
    converter: the same ``cli.main`` in a separate process and session, seconds faster per run,
    which is what lets CI afford a kill and a resume per point."""

    def __init__(self, workdir: Path):
        import multiprocessing

        from dsv4convert.cli import COMMAND_MODULES

        super().__init__(workdir)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torture", "dsv4convert.cli", *COMMAND_MODULES, *CONVERSION_MODULES])

    def start(self, argv: list[str], *, stop: dict | None = None, preexec: Callable[[], None] | None = None) -> Run:
        if preexec is not None:
            raise ValueError("ForkLauncher cannot run a preexec function; use Launcher")
        self.count += 1
        out, err = self.workdir / f"run{self.count}.out", self.workdir / f"run{self.count}.err"
        process = self.context.Process(target=_forked_main, args=(argv, stop, str(out), str(err)), daemon=False)
        process.start()
        run = Run(_Forked(process), out, err, time.monotonic())
        while run.popen.poll() is None and _pgid(process.pid) != process.pid:
            time.sleep(0.0005)  # group signals need the child's own session
        return run


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


class PointNotReached(AssertionError):
    """A run ended without passing the point it was to be stopped at."""


class Stopper:
    """The two FIFOs of one armed stop point (see :mod:`dsv4convert.stop_points`).

    Both are held open read-write here, so the child's ``open`` of either never blocks and a
    child that exits leaves no reader or writer waiting.
    """

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="stop-"))
        self.notify, self.release = self.directory / "notify", self.directory / "release"
        os.mkfifo(self.notify)
        os.mkfifo(self.release)
        self._notify_fd = os.open(self.notify, os.O_RDWR | os.O_NONBLOCK)
        self._release_fd = os.open(self.release, os.O_RDWR)

    def spec(self, point: str, occurrence: int = 1) -> dict:
        return {"at": point, "occurrence": occurrence, "notify": str(self.notify), "release": str(self.release)}

    def wait(self, run: Run, point: str) -> int:
        """Block until ``run`` stops at ``point`` (returns the pid that stopped) or exits (raises)."""
        ready, _, _ = select.select([self._notify_fd, run.exit_fd()], [], [], STOP_WAIT_SECONDS)
        if self._notify_fd in ready:
            pid, reached = os.read(self._notify_fd, 4096).decode().strip().split(" ", 1)
            if reached != point:
                raise AssertionError(f"stopped at {reached!r}, not at {point!r}")
            return int(pid)
        if ready:
            code = run.popen.wait()
            raise PointNotReached(f"the run exited ({code}) without reaching {point!r}; "
                                  f"stderr: {run.output()[1].strip()[-600:]}")
        raise AssertionError(f"neither stopped at {point!r} nor exited within {STOP_WAIT_SECONDS:.0f} s")

    def let_go(self) -> None:
        """Release the stopped thread: the run continues past the point."""
        os.write(self._release_fd, b"x")

    def close(self) -> None:
        os.close(self._notify_fd)
        os.close(self._release_fd)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> "Stopper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- comparing destinations


def _normalized(rel: str, data: bytes, dst: Path) -> bytes:
    if rel in TIMED_FILES:
        obj = json.loads(data)
        obj.pop("started", None)
        return json.dumps(obj, sort_keys=True).encode()
    if rel in PATH_FILES:
        return data.replace(os.fsencode(dst.resolve()), b"DST")
    return data


def snapshot(dst: Path) -> dict[str, str]:
    """sha256 of every file under ``dst`` (hidden ones too), normalized as TIMED_FILES/PATH_FILES say."""
    out = {}
    for path in sorted(dst.rglob("*")):
        if path.is_file():
            rel = path.relative_to(dst).as_posix()
            out[rel] = hashlib.sha256(_normalized(rel, path.read_bytes(), dst)).hexdigest()
    return out


def finished_shards(dst: Path) -> dict[str, tuple[int, int, int]]:
    """Shards the resume state lists as done: name -> (inode, mtime_ns, size)."""
    try:
        state = json.loads((dst / ".dsv4convert" / "state.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for name in state.get("shards", {}):
        st = (dst / name).stat()
        out[name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def problems_after_kill(dst: Path, reference: dict[str, str]) -> list[str]:
    """What a kill must never leave: a torn or foreign file under a final name, an early index,
    or a shard the resume state calls finished that is not byte-identical to the reference."""
    problems = []
    if not dst.exists():
        return problems
    for path in dst.iterdir():
        name = path.name
        if name == ".dsv4convert" or (name.startswith(".") and name.endswith(".partial")):
            continue
        if name not in reference:
            problems.append(f"unexpected file {name}")
        elif name not in TIMED_FILES and hashlib.sha256(_normalized(name, path.read_bytes(), dst)).hexdigest() != reference[name]:
            problems.append(f"{name} is under its final name but differs from the uninterrupted run")
    if (dst / "model.safetensors.index.json").exists():
        missing = [n for n in reference if SHARD_FILE.match(n) and not (dst / n).exists()]
        if missing:
            problems.append(f"index written while shards are missing: {missing[:3]}")
    for name in finished_shards(dst):
        if hashlib.sha256((dst / name).read_bytes()).hexdigest() != reference.get(name):
            problems.append(f"state.json lists {name} as finished but it differs from the reference")
    for leftover in (dst / ".dsv4convert").glob("*") if (dst / ".dsv4convert").exists() else []:
        if leftover.name not in ("state.json", "lock") and not (leftover.name.startswith(".") and
                                                                leftover.name.endswith(".partial")):
            problems.append(f"unexpected file .dsv4convert/{leftover.name}")
    return problems


def compare(dst: Path, reference: dict[str, str]) -> list[str]:
    got = snapshot(dst)
    diffs = [f"missing {n}" for n in reference if n not in got]
    diffs += [f"extra {n}" for n in got if n not in reference]
    diffs += [f"differs {n}" for n in reference if n in got and got[n] != reference[n]]
    return diffs


# --------------------------------------------------------------------------- kill points


@dataclasses.dataclass(frozen=True)
class KillPoint:
    """Where to kill: the ``occurrence``-th time a run reaches stop point ``point``.

    ``label`` names the case independently of the model's size ("middle shard: writing its middle
    tensor"); ``order`` is the position in the reference trace, so points sort as a run meets them.
    """

    label: str
    phase: str
    point: str
    occurrence: int
    order: int


@dataclasses.dataclass(frozen=True)
class TracePoint:
    pid: int
    thread: str
    point: str
    occurrence: int  # 1 for the first time this process passed ``point``


def read_trace(log: Path) -> list[TracePoint]:
    """The points one run passed (a ``{"log": ...}`` stop-point file), with their occurrence numbers."""
    seen: Counter = Counter()
    out = []
    for line in log.read_text().splitlines():
        pid, thread, point = line.split(" ", 2)
        seen[(pid, point)] += 1
        out.append(TracePoint(int(pid), thread, point, seen[(pid, point)]))
    return out


_SHARD_POINT = re.compile(r"^(model-\d{5}-of-\d{5}\.safetensors): (.*)$")


def phase_of(point: str, finalizing: bool) -> str:
    """The conversion phase a stop point belongs to (for the report's table)."""
    if finalizing:
        return "finalize"
    if point.startswith("checkpoint: "):
        return "reading"
    if point.startswith("destination: "):
        return "prepare"
    if point.startswith("lock: "):
        return "lock"
    if point.startswith("resume state ") or point.endswith(": complete"):
        return "state"
    if ": converting module " in point:
        return "quantizing"
    if point.endswith(": renaming its .partial"):
        return "renaming"
    return "writing"


def catalogue(trace: list[TracePoint], *, every_shard: bool, randoms: int = 0, seed: int = 0) -> list[KillPoint]:
    """Kill points on every phase of the reference ``trace``, in the order a run reaches them.

    Start-up (the source index and its middle header, the destination, the lock, the first state
    save); per shard (the first, middle and last, or ``every_shard``): opening its ``.partial``,
    the ``.partial`` opened, writing its middle tensor, converting its middle module, renaming,
    renamed, and the state save after it; finalization (the first small-file copy, every generated
    file's write and rename, the re-inspection of the output, the final state save, releasing the
    lock); and ``randoms`` seeded picks among every other point passed, in any thread.
    """
    main = trace[0].pid
    lines = [t for t in trace if t.pid == main]
    position = {(t.pid, t.point, t.occurrence): i for i, t in enumerate(trace)}
    finalize_at = next(i for i, t in enumerate(lines) if t.point.endswith(": copying"))
    chosen: dict[str, TracePoint] = {}

    def take(label: str, item: TracePoint | None) -> None:
        if item is not None:
            chosen[label] = item

    def first(predicate: Callable[[TracePoint], bool], among: list[TracePoint] = lines) -> TracePoint | None:
        return next((t for t in among if predicate(t)), None)

    startup = lines[:finalize_at]
    headers = [t for t in startup if t.point.startswith("checkpoint: reading header ")]
    take("source: reading the index", first(lambda t: t.point == "checkpoint: reading the index", startup))
    take("source: reading its middle shard header", headers[len(headers) // 2] if headers else None)
    for name in ("destination: creating it", "lock: writing its draft", "lock: linking",
                 "resume state (0 shards): writing", "resume state (0 shards): renaming"):
        take(name, first(lambda t, name=name: t.point == name, startup))

    shards = sorted({m.group(1) for t in trace if (m := _SHARD_POINT.match(t.point))})
    picks = {s: s for s in shards} if every_shard else {
        f"{where} shard": shard for where, shard in (("first", shards[0]), ("middle", shards[len(shards) // 2]),
                                                     ("last", shards[-1]))}
    for where, shard in picks.items():
        of_shard = [t for t in trace if t.point.startswith(f"{shard}: ")]
        tensors = [t for t in of_shard if ": writing tensor " in t.point]
        modules = [t for t in of_shard if ": converting module " in t.point]
        for step in ("opening its .partial", ".partial opened"):
            take(f"{where}: {step}", first(lambda t, step=step: t.point == f"{shard}: {step}", of_shard))
        take(f"{where}: writing its middle tensor", tensors[len(tensors) // 2] if tensors else None)
        take(f"{where}: converting its middle module", modules[len(modules) // 2] if modules else None)
        renamed = first(lambda t: t.point == f"{shard}: complete", lines)
        take(f"{where}: renaming its .partial", first(lambda t: t.point == f"{shard}: renaming its .partial", of_shard))
        take(f"{where}: renamed, resume state not yet written", renamed)
        if renamed is not None:
            after = lines[lines.index(renamed) + 1:]
            take(f"{where}: resume state written, before its rename",
                 first(lambda t: t.point.startswith("resume state (") and t.point.endswith(": renaming"), after))
            take(f"{where}: resume state being written",
                 first(lambda t: t.point.startswith("resume state (") and t.point.endswith(": writing"), after))

    finalize = lines[finalize_at:]
    take("finalize: copying the first small file", finalize[0])
    output_headers = [t for t in finalize if t.point.startswith("checkpoint: reading header ")]
    take("finalize: reading an output shard header", output_headers[len(output_headers) // 2] if output_headers else None)
    for t in finalize:
        if t.point.endswith(": copying") or t.point.startswith("checkpoint: reading header "):
            continue
        take("finalize: " + re.sub(r"^resume state \(\d+ shards, complete\)", "final resume state", t.point), t)

    points = [KillPoint(label, phase_of(t.point, label.startswith("finalize: ")), t.point, t.occurrence,
                        position[(t.pid, t.point, t.occurrence)])
              for label, t in chosen.items()]
    taken = {(p.point, p.occurrence) for p in points}
    rest = [t for t in trace if (t.point, t.occurrence) not in taken and t.pid == main]
    rng = random.Random(seed)
    for i, t in enumerate(rng.sample(rest, min(randoms, len(rest)))):
        points.append(KillPoint(f"random point {i + 1} (seed {seed})", "random", t.point, t.occurrence,
                                position[(t.pid, t.point, t.occurrence)]))
    return sorted(points, key=lambda p: p.order)


def state_lists(count: int) -> Callable[[Path], bool]:
    def predicate(dst: Path) -> bool:
        try:
            return len(json.loads((dst / ".dsv4convert" / "state.json").read_text())["shards"]) >= count
        except (OSError, ValueError, KeyError):
            return False
    return predicate


# --------------------------------------------------------------------------- the torture loop


@dataclasses.dataclass
class Outcome:
    point: str
    phase: str
    stopped_at: str
    recipe: str
    killed: bool
    exit_status: int | None
    problems_after_kill: list[str]
    finished_before_resume: int
    bytes_lost: int
    bytes_redone: int
    identical: bool
    diffs: list[str]
    seconds: float


class Torture:
    """One recipe on one source: the reference run, then kill/resume cycles against it."""

    def __init__(self, launcher: Launcher, src: Path, workdir: Path, recipe: str, *, shard_bytes: int,
                 workers: int = 1, timeout: float = 600.0):
        self.launcher, self.src, self.workdir, self.recipe = launcher, src.resolve(), workdir, recipe
        self.shard_bytes, self.workers, self.timeout = shard_bytes, workers, timeout
        self.reference: dict[str, str] = {}
        self.sizes: dict[str, int] = {}  # output shard name -> bytes
        self.trace: list[TracePoint] = []
        self.duration = 0.0

    def argv(self, dst: Path, *, resume: bool) -> list[str]:
        return [f"to-{self.recipe}", "--src", str(self.src), "--dst", str(dst), "--no-progress",
                "--max-shard-size", str(self.shard_bytes), "--workers", str(self.workers)] + (["--resume"] if resume else [])

    def make_reference(self) -> Path:
        """An uninterrupted run: its files are the reference, its stop-point log the trace."""
        dst = self.workdir / f"reference-{self.recipe}"
        shutil.rmtree(dst, ignore_errors=True)
        log = self.workdir / f"trace-{self.recipe}.log"
        log.unlink(missing_ok=True)
        run = self.launcher.start(self.argv(dst, resume=False), stop={"log": str(log)})
        code = run.wait(self.timeout)
        self.duration = time.monotonic() - run.started
        if code != 0:
            raise RuntimeError(f"reference conversion failed ({code}): {run.output()[1][-2000:]}")
        self.reference = snapshot(dst)
        self.sizes = {p.name: p.stat().st_size for p in dst.iterdir() if SHARD_FILE.match(p.name)}
        self.trace = read_trace(log)
        return dst

    def catalogue(self, *, every_shard: bool, randoms: int = 0, seed: int = 0) -> dict[str, KillPoint]:
        return {p.label: p for p in catalogue(self.trace, every_shard=every_shard, randoms=randoms, seed=seed)}

    def stopped_run(self, dst: Path, point: KillPoint, stopper: Stopper, *, resume: bool,
                    extra: list[str] = ()) -> tuple[Run, int]:
        """A run started with ``point`` armed, stopped there: (the run, the pid that stopped).
        Raises PointNotReached when the run ends without reaching it."""
        run = self.launcher.start(self.argv(dst, resume=resume) + list(extra),
                                  stop=stopper.spec(point.point, point.occurrence))
        try:
            return run, stopper.wait(run, point.point)
        except BaseException:
            run.kill_group()
            run.popen.wait()
            raise

    def kill_run(self, dst: Path, point: KillPoint, *, resume: bool) -> int:
        """Run to ``point`` and SIGKILL the whole process group there; returns the exit status."""
        with Stopper() as stopper:
            run, _ = self.stopped_run(dst, point, stopper, resume=resume)
            run.kill_group(signal.SIGKILL)
            code = run.wait(self.timeout)
        if code != -signal.SIGKILL:
            raise RuntimeError(f"{point.label}: conversion exited {code} instead of being killed: "
                               f"{run.output()[1][-2000:]}")
        return code

    def resume(self, dst: Path) -> str | None:
        """Resume to the end; the failure (exit status and stderr) when it does not finish."""
        run = self.launcher.start(self.argv(dst, resume=True))
        code = run.wait(self.timeout)
        return None if code == 0 else f"resume exited {code}: {run.output()[1].strip()[-600:]}"

    def survive(self, point: KillPoint, dst: Path) -> Outcome:
        """Fresh destination, kill at ``point``, check, resume, compare."""
        t0 = time.monotonic()
        shutil.rmtree(dst, ignore_errors=True)
        code = self.kill_run(dst, point, resume=False)
        problems = problems_after_kill(dst, self.reference)
        finished = finished_shards(dst)
        error = self.resume(dst)
        after = {n: (st.st_ino, st.st_mtime_ns, st.st_size) for n in finished if (st := (dst / n).stat())}
        lost = sum(size for n, (_, _, size) in finished.items() if after.get(n) != finished[n])
        total = sum(self.sizes.values())
        redone = total - sum(size for _, _, size in finished.values())
        diffs = [error] if error else compare(dst, self.reference)
        return Outcome(point.label, point.phase, point.point, self.recipe, True, code, problems, len(finished),
                       lost, redone, not diffs, diffs, time.monotonic() - t0)

    def interrupt(self, dst: Path, sig: int, point: KillPoint, *, group: bool) -> dict:
        """SIGTERM/SIGINT while the main thread is stopped at ``point``: must exit 2 with one line naming
        --resume, leave no .partial and no lock, and resume identically."""
        shutil.rmtree(dst, ignore_errors=True)
        with Stopper() as stopper:
            run, _ = self.stopped_run(dst, point, stopper, resume=False)
            if group:
                os.killpg(run.popen.pid, sig)
            else:
                run.popen.send_signal(sig)
            code = run.wait(self.timeout)
        _, err = run.output()
        leftovers = sorted(p.name for p in dst.glob(".*.partial")) + (
            ["lock"] if (dst / ".dsv4convert" / "lock").exists() else [])
        error = self.resume(dst)
        diffs = [error] if error else compare(dst, self.reference)
        return {"signal": signal.Signals(sig).name, "when": point.label, "exit_status": code,
                "stderr": err.strip(), "leftovers": leftovers, "identical": not diffs, "diffs": diffs}


# The main-thread points the signal cases stop at (a handler raising there interrupts the stop).
SIGNAL_POINTS = ("first shard: .partial opened", "middle shard: opening its .partial",
                 "finalize: output: re-inspecting")


# --------------------------------------------------------------------------- the script


def synthesize(src: Path, preset: str) -> None:
    if not (src / "model.safetensors.index.json").exists():
        subprocess.run([sys.executable, "-m", "dsv4convert", "synth", "--preset", preset, "--dst", str(src)],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--recipes", default="fp8,nvfp4")
    parser.add_argument("--shard-size", type=int, default=None, help="output shard bound in bytes "
                        "(default: about 1/12 of the output, so every run spans many shards)")
    parser.add_argument("--randoms", type=int, default=6,
                        help="seeded random picks among every point of the trace, per recipe")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--launcher", choices=("fork", "exec"), default="fork",
                        help="fork: conversions forked from a pre-imported server (fast); exec: a fresh "
                             "`python -m dsv4convert` per run. SIGTERM/Ctrl-C always use exec")
    parser.add_argument("--sample-shards", action="store_true",
                        help="shard-level kill points on the first, middle and last shard only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fuzz-examples", type=int, default=0,
                        help="also run tests/test_fuzz_parsers.py with this many cases per fuzz test")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="torture-"))
    workdir.mkdir(parents=True, exist_ok=True)
    recipes = [r for r in args.recipes.split(",") if r]
    src = workdir / f"src-{args.preset}"
    if recipes:
        synthesize(src, args.preset)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    shard_bytes = args.shard_size or max(200_000, source_bytes // 12)
    launcher = ForkLauncher(workdir) if args.launcher == "fork" else Launcher(workdir)
    real = Launcher(workdir)
    report: dict = {"command": " ".join(shlex.quote(a) for a in ["python", "bench/torture.py", *(argv or sys.argv[1:])]),
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
                    "commit": _git_commit(), "preset": args.preset, "source_bytes": source_bytes,
                    "shard_bytes": shard_bytes, "workers": args.workers, "launcher": args.launcher, "recipes": {}}
    t_start = time.monotonic()
    try:
        for recipe in recipes:
            torture = Torture(launcher, src, workdir, recipe, shard_bytes=shard_bytes, workers=args.workers)
            torture.make_reference()
            points = list(torture.catalogue(every_shard=not args.sample_shards, randoms=args.randoms,
                                            seed=args.seed).values())
            print(f"{recipe}: reference {torture.duration:.1f} s, {len(torture.sizes)} shards, "
                  f"{len(torture.trace)} stop points passed, {len(points)} kill points", flush=True)
            outcomes = []
            for point in points:
                try:
                    outcome = torture.survive(point, workdir / f"dst-{recipe}")
                except PointNotReached as exc:
                    outcome = Outcome(point.label, point.phase, point.point, recipe, False, None, [], 0, 0, 0,
                                      False, [str(exc)], 0.0)
                outcomes.append(outcome)
                flag = "ok" if outcome.identical and not outcome.problems_after_kill and not outcome.bytes_lost else "FAIL"
                print(f"  {flag:4s} {point.phase:10s} {point.label} [{point.point}] "
                      f"(finished before resume {outcome.finished_before_resume})", flush=True)
            signals = []
            by_exec = Torture(real, src, workdir, recipe, shard_bytes=shard_bytes, workers=args.workers)
            by_exec.make_reference()  # its own: a fork server keeps the code it imported at start
            at = by_exec.catalogue(every_shard=False)
            for sig, group in ((signal.SIGTERM, False), (signal.SIGINT, True)):
                for label in SIGNAL_POINTS:
                    result = by_exec.interrupt(workdir / f"sig-{recipe}", sig, at[label], group=group)
                    signals.append(result)
                    print(f"  {result['signal']} at {label}: exit {result['exit_status']}, identical {result['identical']}, "
                          f"stderr {result['stderr'][-160:]!r}", flush=True)
            report["recipes"][recipe] = {
                "reference_seconds": round(torture.duration, 2),
                "output_shards": len(torture.sizes),
                "output_bytes": sum(torture.sizes.values()),
                "stop_points_passed": len(torture.trace),
                "outcomes": [dataclasses.asdict(o) for o in outcomes],
                "signals": signals,
            }
        if args.fuzz_examples:
            report["fuzz"] = run_fuzz(args.fuzz_examples)
            print(f"fuzz: {report['fuzz']}", flush=True)
    finally:
        launcher.close()
        real.close()
    report["seconds"] = round(time.monotonic() - t_start, 1)
    report["summary"] = summarize(report)
    out = args.out or REPO / "bench" / "results" / f"torture-{args.preset}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(render_markdown(report))
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if report["summary"]["failures"] == 0 else 1


def run_fuzz(examples: int) -> dict:
    """The CI fuzz tests with more cases (random, not derandomized, above 500 per test)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_parsers.py"],
                          cwd=REPO, env={**os.environ, "DSV4_FUZZ_EXAMPLES": str(examples)},
                          capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", tail)) else 0
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", tail)) else 0
    return {"examples_per_test": examples, "tests": passed + failed, "passed": passed, "failed": failed,
            "cases": (passed + failed) * examples, "seconds": round(time.monotonic() - t0, 1), "pytest": tail}


def summarize(report: dict) -> dict:
    outcomes = [o for r in report["recipes"].values() for o in r["outcomes"]]
    signals = [s for r in report["recipes"].values() for s in r["signals"]]
    killed = [o for o in outcomes if o["killed"]]
    failures = [o for o in outcomes if not o["identical"] or o["problems_after_kill"] or o["bytes_lost"]]
    bad_signals = [s for s in signals if s["exit_status"] != 2 or "--resume" not in s["stderr"]
                   or not s["identical"] or s["leftovers"]]
    return {
        "kill_points": len(outcomes),
        "killed": len(killed),
        "distinct_points_killed": len({(o["recipe"], o["point"]) for o in killed}),
        "phases": sorted({o["phase"] for o in killed}),
        "identical_after_resume": sum(o["identical"] for o in outcomes),
        "bytes_lost": sum(o["bytes_lost"] for o in outcomes),
        "signals": len(signals),
        "signals_clean": len(signals) - len(bad_signals),
        "failures": len(failures) + len(bad_signals) + report.get("fuzz", {}).get("failed", 0),
    }


def render_markdown(report: dict) -> str:
    """The tables docs/reliability.md quotes: kill points per phase, signals, fuzzing."""
    lines = [f"Command: `{report['command']}` (commit {report['commit']}, {report['machine']['cpus']} CPUs, "
             f"{report['seconds']} s)", ""]
    for recipe, result in report["recipes"].items():
        lines += [f"**{recipe}** ({report['preset']} preset: {result['output_shards']} output shards, "
                  f"{result['output_bytes']} bytes, uninterrupted run {result['reference_seconds']} s)", "",
                  "| phase | kill points | killed | identical after resume | torn files | bytes lost |",
                  "|---|---:|---:|---:|---:|---:|"]
        groups: dict[str, list[dict]] = {}
        for o in result["outcomes"]:
            groups.setdefault(o["phase"], []).append(o)
        for phase, rows in groups.items():
            lines.append(f"| {phase} | {len(rows)} | {sum(r['killed'] for r in rows)} | "
                         f"{sum(r['identical'] for r in rows)} | {sum(len(r['problems_after_kill']) for r in rows)} | "
                         f"{sum(r['bytes_lost'] for r in rows)} |")
        failed = [o for o in result["outcomes"] if not o["identical"]]
        lines += [""] + [f"- not identical: {o['point']}: {o['diffs'][0][:200]}" for o in failed]
        lines += ["", "| signal | stopped at | exit | stderr | leftovers | identical after resume |",
                  "|---|---|---:|---|---|---|"]
        for sig in result["signals"]:
            lines.append(f"| {sig['signal']} | {sig['when']} | "
                         f"{sig['exit_status']} | `{sig['stderr'][-150:]}` | {', '.join(sig['leftovers']) or 'none'} | "
                         f"{sig['identical']} |")
        lines.append("")
    if "fuzz" in report:
        fuzz = report["fuzz"]
        lines += [f"Fuzzing: {fuzz['tests']} hypothesis tests x {fuzz['examples_per_test']} cases = {fuzz['cases']} "
                  f"cases in {fuzz['seconds']} s: {fuzz['pytest']}", ""]
    summary = report["summary"]
    lines.append("Summary: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    return "\n".join(lines) + "\n"


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
