"""Crash torture: kill real conversions at chosen points, resume, and compare every byte.

A conversion of the real model runs for an hour on machines that get preempted, so a kill
at any moment must leave a destination that ``--resume`` finishes into exactly the files an
uninterrupted run writes. This script proves it without hooks in the product:

* ``event`` kill points: an audit hook (``sys.addaudithook``, installed by a throw-away
  ``sitecustomize`` in the child only) SIGKILLs the conversion's whole process group right
  before the n-th matching file operation: reading the index or a header, taking the lock,
  opening or renaming a shard's ``.partial``, saving the resume state, writing the index...
  The points are picked from a trace of an uninterrupted run, so they cover every phase.
* ``watch`` kill points: a poller SIGKILLs the group once the destination shows a state,
  e.g. a ``.partial`` holding half of its bytes (mid-write) or ``state.json`` listing k shards.
* ``delay`` kill points: SIGKILL after a seeded random fraction of the measured run time.

After each kill it checks that nothing under a final name is torn (every final-named file is
byte-identical to the reference, no index before all shards), snapshots the shards the resume
state lists as finished, resumes, and checks that the result is byte-identical to the
uninterrupted run (``provenance.json``/``state.json`` compared without their start time) and
that no finished shard was rewritten (bytes lost). SIGTERM and Ctrl-C (SIGINT to the group)
must stop with a one-line message naming ``--resume``, exit 2, and resume identically.

    python bench/torture.py                                   # small preset, fp8 + nvfp4
    python bench/torture.py --preset tiny --recipes nvfp4 --launcher fork --out /tmp/t.json

Results go to ``bench/results/torture-<preset>.json``; ``docs/reliability.md`` has the table.
The module imports only the standard library at top level: it also runs inside every child
(through ``sitecustomize``) to install the kill hook.
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
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILL_ENV = "DSV4_TORTURE_KILL"
# Files whose JSON records the wall-clock start of the run; compared without that field.
TIMED_FILES = ("provenance.json", ".dsv4convert/state.json")
# Files that name the destination itself (the model card's launch commands); compared with it replaced.
PATH_FILES = ("README.md",)
SHARD_FILE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")

# --------------------------------------------------------------------------- child side: the kill hook

_AUDITED = ("open", "os.rename", "os.link", "os.remove", "os.mkdir", "shutil.copyfile")
_FD_OPEN = re.compile(r"^open \d+ ")  # io.open of a descriptor, e.g. the lock file's os.fdopen
_OS_OPEN_MODES = {os.O_RDONLY: "r", os.O_WRONLY: "w", os.O_RDWR: "r+"}


def describe_event(event: str, args: tuple, roots: dict[str, str]) -> str | None:
    """One line per audited file operation, with the source/destination roots shortened to SRC/DST."""

    def short(path: object) -> str:
        text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
        for label, root in roots.items():
            if text == root or text.startswith(root + os.sep):
                return label + text[len(root):]
        return text

    if event == "open":  # io.open passes its mode; os.open None and its flags, shown as the same letters
        mode = args[1] if isinstance(args[1], str) else _OS_OPEN_MODES[args[2] & os.O_ACCMODE]
        return f"open {short(args[0])} {mode}"
    if event == "os.rename":
        return f"rename {short(args[0])} -> {short(args[1])}"
    if event == "os.link":
        return f"link {short(args[0])} -> {short(args[1])}"
    if event == "os.remove":
        return f"remove {short(args[0])}"
    if event == "os.mkdir":
        return f"mkdir {short(args[0])}"
    if event == "shutil.copyfile":
        return f"copy {short(args[0])} -> {short(args[1])}"
    return None


def install_kill_hook(spec: dict) -> None:
    """SIGKILL this process group at the end of ``spec['steps']`` (regexes matched in order), or
    append every event line to ``spec['log']``. Runs inside the conversion process."""
    roots = {"DST": spec["dst"], "SRC": spec["src"]}
    steps = [re.compile(s) for s in spec.get("steps", [])]
    log_fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if spec.get("log") else None
    position = [0]

    def hook(event: str, args: tuple) -> None:
        if event not in _AUDITED:
            return
        line = describe_event(event, args, roots)
        if line is None:
            return
        if log_fd is not None and ("DST" in line or "SRC" in line or _FD_OPEN.match(line)):
            os.write(log_fd, f"{os.getpid()} {line}\n".encode())
        if steps and steps[position[0]].search(line):
            position[0] += 1
            if position[0] == len(steps):
                os.killpg(os.getpgrp(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def _sitecustomize_dir() -> Path:
    """A directory whose sitecustomize installs the kill hook when KILL_ENV is set (children only)."""
    directory = Path(tempfile.mkdtemp(prefix="torture-site-"))
    (directory / "sitecustomize.py").write_text(
        "import json, os, sys\n"
        f"if os.environ.get({KILL_ENV!r}):\n"
        f"    sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "    import torture\n"
        f"    torture.install_kill_hook(json.loads(os.environ[{KILL_ENV!r}]))\n"
    )
    return directory


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


class Launcher:
    """Starts ``python -m dsv4convert <argv>`` subprocesses, optionally with a kill hook or limits."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.site = _sitecustomize_dir()
        self.count = 0

    def start(self, argv: list[str], *, kill: dict | None = None, preexec: Callable[[], None] | None = None) -> Run:
        self.count += 1
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.site), str(REPO), os.environ.get("PYTHONPATH", "")])}
        env.pop(KILL_ENV, None)
        if kill:
            env[KILL_ENV] = json.dumps(kill)
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
        shutil.rmtree(self.site, ignore_errors=True)


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


def _forked_main(argv: list[str], kill: dict | None, out: str, err: str) -> None:
    """Body of a forked conversion: what ``python -m dsv4convert`` does, minus interpreter start-up."""
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if kill:
        install_kill_hook(kill)
    from dsv4convert.cli import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkLauncher(Launcher):
    """Like Launcher, but forks each conversion from a server that has already imported torch and
    dsv4convert: the same ``cli.main`` in a separate process and session, seconds faster per run,
    which is what lets CI afford dozens of kills."""

    def __init__(self, workdir: Path):
        import multiprocessing

        from dsv4convert.cli import COMMAND_MODULES

        super().__init__(workdir)
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["torture", "dsv4convert.cli", *COMMAND_MODULES])

    def start(self, argv: list[str], *, kill: dict | None = None, preexec: Callable[[], None] | None = None) -> Run:
        if preexec is not None:
            raise ValueError("ForkLauncher cannot run a preexec function; use Launcher")
        self.count += 1
        out, err = self.workdir / f"run{self.count}.out", self.workdir / f"run{self.count}.err"
        process = self.context.Process(target=_forked_main, args=(argv, kill, str(out), str(err)), daemon=False)
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
    """Where to kill: ``steps`` (event regexes, in order), a ``watch`` predicate on DST, or a ``delay``.

    ``order`` is the position in the reference trace where the kill lands, so chained runs can
    visit the points in the order a conversion reaches them.
    """

    name: str
    phase: str
    order: float
    steps: tuple[str, ...] = ()
    watch: Callable[[Path], bool] | None = None
    delay: float | None = None

    @property
    def strategy(self) -> str:
        return "event" if self.steps else "watch" if self.watch else "delay"


def _esc(text: str) -> str:
    return re.escape(text)


def fires_at(steps: tuple[str, ...], lines: list[str]) -> int | None:
    """Index of the trace line where the hook would kill, or None when the run never gets there."""
    position = 0
    for i, line in enumerate(lines):
        if re.search(steps[position], line):
            position += 1
            if position == len(steps):
                return i
    return None


SOURCE_READ = r"^open SRC/model-\d+-of-\d+\.safetensors r$"
STATE_WRITE = _esc("open DST/.dsv4convert/.state.json.partial w")
STATE_RENAME = _esc("rename DST/.dsv4convert/.state.json.partial")
# Kills between creating DST/.dsv4convert and the first state save leave our state directory
# without a state file; a rerun (plain or --resume) must accept it.
NO_STATE_WINDOW = ("taking the lock", "lock holder drafted, lock not yet linked", "first resume-state write",
                   "first resume-state rename")


def trace_points(trace: list[str], sizes: dict[str, int], duration: float, *, seed: int,
                 delays: int, every_shard: bool) -> list[KillPoint]:
    """Kill points across every phase, chosen from the event trace of an uninterrupted run
    (lines without their pid prefix), in the order the run reaches them."""
    lines = [line.split(" ", 1)[1] for line in trace]
    shards = sorted(sizes)
    first_dst = next(i for i, line in enumerate(lines) if "DST" in line)
    header_reads = sum(1 for line in lines[:first_dst] if re.match(SOURCE_READ, line))
    candidates: list[tuple[str, str, tuple[str, ...]]] = [
        ("reading the source index", "reading", (_esc("open SRC/model.safetensors.index.json"),)),
        (f"reading shard header {header_reads // 2 + 1} of {header_reads}", "reading",
         (SOURCE_READ,) * (header_reads // 2 + 1)),
        ("creating the destination", "prepare", (r"^mkdir DST$",)),
        (NO_STATE_WINDOW[0], "lock", (r"^open DST/\.dsv4convert/\.lock\.\d+\.partial w",)),
        (NO_STATE_WINDOW[1], "lock", (r"^link DST/\.dsv4convert/\.lock\.\d+\.partial -> DST/\.dsv4convert/lock$",)),
        (NO_STATE_WINDOW[2], "state", (STATE_WRITE,)),
        (NO_STATE_WINDOW[3], "state", (STATE_RENAME,)),
    ]
    picks = shards if every_shard else sorted({shards[0], shards[len(shards) // 2], shards[-1]})
    for shard in picks:
        partial = _esc(f"DST/.{shard}.partial")
        k = int(SHARD_FILE.match(shard).group(1))
        opened, renamed = f"^open {partial} w$", f"^rename {partial} "
        candidates.append((f"shard {k}: opening its .partial", "writing", (opened,)))
        reads = _reads_while_writing(lines, shard)
        if reads >= 2:
            candidates.append((f"shard {k}: quantizing, source tensor {reads // 2 + 1} of {reads}", "quantizing",
                               (opened,) + (SOURCE_READ,) * (reads // 2 + 1)))
        candidates.append((f"shard {k}: .partial complete, before its rename", "renaming", (renamed,)))
        candidates.append((f"shard {k}: renamed, resume state not yet written", "state", (renamed, STATE_WRITE)))
        candidates.append((f"shard {k}: resume state written, before its rename", "state", (renamed, STATE_RENAME)))
    index_rename = _esc("rename DST/.model.safetensors.index.json.partial")
    readme = _esc("rename DST/.README.md.partial")
    anchor = r"^copy SRC/"  # finalizing starts by copying the small files, in every run
    for name, regexes in [
        ("copying small files", ()),
        ("writing config.json", (_esc("open DST/.config.json.partial w"),)),
        ("renaming config.json", (_esc("rename DST/.config.json.partial"),)),
        ("writing hf_quant_config.json", (_esc("open DST/.hf_quant_config.json.partial w"),)),
        ("writing provenance.json", (_esc("open DST/.provenance.json.partial w"),)),
        ("writing the index", (_esc("open DST/.model.safetensors.index.json.partial w"),)),
        ("renaming the index", (index_rename,)),
        ("re-inspecting the output, index in place", (index_rename, r"^open DST/model-\d+-of-\d+\.safetensors r$")),
        ("writing the model card", (_esc("open DST/.README.md.partial w"),)),
        ("renaming the model card", (readme,)),
        ("final resume-state save", (readme, STATE_WRITE)),
        ("releasing the lock", (readme, _esc("remove DST/.dsv4convert/lock"))),
    ]:
        candidates.append((f"finalize: {name}", "finalize", (anchor, *regexes)))
    points = [KillPoint(name, phase, at, steps) for name, phase, steps in candidates
              if (at := fires_at(steps, lines)) is not None]

    biggest = max(shards, key=sizes.__getitem__)
    opened = fires_at((f"^open {_esc(f'DST/.{biggest}.partial')} w$",), lines)
    points.append(KillPoint(f"mid-write: {biggest}'s .partial half written (watched)", "writing", opened + 0.5,
                            watch=partial_at_least(biggest, sizes[biggest] // 2)))
    second_save = fires_at((STATE_RENAME,) * 3, lines)  # the first save precedes any shard
    points.append(KillPoint("resume state lists 2 shards (watched)", "state", second_save + 0.5,
                            watch=state_lists(2)))
    rng = random.Random(seed)
    for i in range(delays):
        fraction = rng.uniform(0.05, 0.95)
        points.append(KillPoint(f"random moment {i + 1}: {fraction:.0%} into the run", "random",
                                fraction * len(lines), delay=fraction * duration))
    return sorted(points, key=lambda p: p.order)


def _reads_while_writing(lines: list[str], shard: str) -> int:
    start = lines.index(f"open DST/.{shard}.partial w")
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(f"rename DST/.{shard}.partial"))
    return sum(1 for line in lines[start:end] if re.match(SOURCE_READ, line))


def partial_at_least(shard: str, nbytes: int) -> Callable[[Path], bool]:
    def predicate(dst: Path) -> bool:
        try:
            return (dst / f".{shard}.partial").stat().st_size >= nbytes
        except OSError:
            return False
    return predicate


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
    strategy: str
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
        self.trace: list[str] = []
        self.duration = 0.0

    def argv(self, dst: Path, *, resume: bool) -> list[str]:
        return [f"to-{self.recipe}", "--src", str(self.src), "--dst", str(dst), "--no-progress",
                "--max-shard-size", str(self.shard_bytes), "--workers", str(self.workers)] + (["--resume"] if resume else [])

    def kill_spec(self, dst: Path, **extra) -> dict:
        return {"dst": str(dst.resolve()), "src": str(self.src), **extra}

    def make_reference(self) -> Path:
        dst = self.workdir / f"reference-{self.recipe}"
        shutil.rmtree(dst, ignore_errors=True)
        log = self.workdir / f"trace-{self.recipe}.log"
        log.unlink(missing_ok=True)
        run = self.launcher.start(self.argv(dst, resume=False), kill=self.kill_spec(dst, log=str(log)))
        code = run.wait(self.timeout)
        self.duration = time.monotonic() - run.started
        if code != 0:
            raise RuntimeError(f"reference conversion failed ({code}): {run.output()[1][-2000:]}")
        self.reference = snapshot(dst)
        self.sizes = {p.name: p.stat().st_size for p in dst.iterdir() if SHARD_FILE.match(p.name)}
        main_pid = str(run.popen.pid)
        self.trace = [line for line in log.read_text().splitlines() if line.split(" ", 1)[0] == main_pid]
        return dst

    def start_killable(self, dst: Path, point: KillPoint, *, resume: bool) -> Run:
        kill = self.kill_spec(dst, steps=list(point.steps)) if point.steps else None
        return self.launcher.start(self.argv(dst, resume=resume), kill=kill)

    def kill_run(self, dst: Path, point: KillPoint, *, resume: bool) -> tuple[bool, int]:
        """Run until the point kills it; returns (killed, exit status)."""
        run = self.start_killable(dst, point, resume=resume)
        if point.watch is not None:
            _kill_when(run, lambda: point.watch(dst), self.timeout)
        elif point.delay is not None:
            _kill_when(run, lambda: time.monotonic() - run.started >= point.delay, self.timeout)
        code = run.wait(self.timeout)
        if code not in (0, -signal.SIGKILL):
            raise RuntimeError(f"{point.name}: conversion exited {code}: {run.output()[1][-2000:]}")
        return code == -signal.SIGKILL, code

    def resume(self, dst: Path) -> str | None:
        """Resume to the end; the failure (exit status and stderr) when it does not finish."""
        run = self.launcher.start(self.argv(dst, resume=True))
        code = run.wait(self.timeout)
        return None if code == 0 else f"resume exited {code}: {run.output()[1].strip()[-600:]}"

    def survive(self, point: KillPoint, dst: Path) -> Outcome:
        """Fresh destination, kill at ``point``, check, resume, compare."""
        t0 = time.monotonic()
        shutil.rmtree(dst, ignore_errors=True)
        killed, code = self.kill_run(dst, point, resume=False)
        return self._resume_and_check(point, dst, killed, code, t0)

    def _resume_and_check(self, point: KillPoint, dst: Path, killed: bool, code: int, t0: float) -> Outcome:
        problems = problems_after_kill(dst, self.reference)
        finished = finished_shards(dst)
        error = self.resume(dst)
        after = {n: (st.st_ino, st.st_mtime_ns, st.st_size) for n in finished if (st := (dst / n).stat())}
        lost = sum(size for n, (_, _, size) in finished.items() if after.get(n) != finished[n])
        total = sum(self.sizes.values())
        redone = total - sum(size for _, _, size in finished.values())
        diffs = [error] if error else compare(dst, self.reference)
        return Outcome(point.name, point.phase, point.strategy, self.recipe, killed, code, problems, len(finished),
                       lost, redone, not diffs, diffs, time.monotonic() - t0)

    def chain(self, points: list[KillPoint], dst: Path) -> list[Outcome]:
        """Kill at each point in turn, each run resuming the previous one; check after each kill
        and compare once at the end (cheap enough for CI)."""
        shutil.rmtree(dst, ignore_errors=True)
        outcomes = []
        for i, point in enumerate(points):
            t0 = time.monotonic()
            before = finished_shards(dst)
            killed, code = self.kill_run(dst, point, resume=i > 0)
            after = finished_shards(dst)
            lost = sum(size for n, (_, _, size) in before.items() if after.get(n) != before[n])
            problems = problems_after_kill(dst, self.reference)
            outcomes.append(Outcome(point.name, point.phase, point.strategy, self.recipe, killed, code, problems,
                                    len(after), lost, 0, True, [], time.monotonic() - t0))
        error = self.resume(dst)
        diffs = [error] if error else compare(dst, self.reference)
        for outcome in outcomes:
            outcome.identical, outcome.diffs = not diffs, diffs
        return outcomes

    def interrupt(self, dst: Path, sig: int, *, when: Callable[[Path], bool], group: bool) -> dict:
        """SIGTERM/SIGINT once ``when(dst)`` holds: must exit 2 with one line naming --resume, leave no
        .partial and no lock, and resume identically."""
        shutil.rmtree(dst, ignore_errors=True)
        run = self.launcher.start(self.argv(dst, resume=False))
        deadline = time.monotonic() + self.timeout
        while not when(dst) and run.popen.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        delivered = run.popen.poll() is None
        if delivered:
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
        return {"signal": signal.Signals(sig).name, "delivered": delivered, "exit_status": code,
                "stderr": err.strip(), "leftovers": leftovers, "identical": not diffs, "diffs": diffs}


def _kill_when(run: Run, condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while run.popen.poll() is None and time.monotonic() < deadline:
        if condition():
            run.kill_group()
            return
        time.sleep(0.001)


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
    parser.add_argument("--delays", type=int, default=6, help="random-moment kills per recipe")
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
            points = trace_points(torture.trace, torture.sizes, torture.duration, seed=args.seed,
                                  delays=args.delays, every_shard=not args.sample_shards)
            print(f"{recipe}: reference {torture.duration:.1f} s, {len(torture.sizes)} shards, "
                  f"{len(points)} kill points", flush=True)
            outcomes = []
            for point in points:
                outcome = torture.survive(point, workdir / f"dst-{recipe}")
                outcomes.append(outcome)
                flag = "ok" if outcome.identical and not outcome.problems_after_kill and not outcome.bytes_lost else "FAIL"
                print(f"  {flag:4s} {point.strategy:5s} {point.phase:10s} {point.name} "
                      f"(killed={outcome.killed}, finished before resume {outcome.finished_before_resume})", flush=True)
            signals = []
            by_exec = Torture(real, src, workdir, recipe, shard_bytes=shard_bytes, workers=args.workers)
            by_exec.make_reference()  # its own: a fork server keeps the code it imported at start
            for sig, group in ((signal.SIGTERM, False), (signal.SIGINT, True)):
                for label, when in (("first .partial open", any_partial), ("state lists 1 shard", state_lists(1)),
                                    ("index written", _exists("model.safetensors.index.json"))):
                    result = by_exec.interrupt(workdir / f"sig-{recipe}", sig, when=when, group=group)
                    result["when"] = label
                    signals.append(result)
                    print(f"  {result['signal']} at {label}: exit {result['exit_status']}, identical {result['identical']}, "
                          f"stderr {result['stderr'][-160:]!r}", flush=True)
            report["recipes"][recipe] = {
                "reference_seconds": round(torture.duration, 2),
                "output_shards": len(torture.sizes),
                "output_bytes": sum(torture.sizes.values()),
                "trace_events": len(torture.trace),
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


def _exists(name: str) -> Callable[[Path], bool]:
    return lambda dst: (dst / name).exists()


def any_partial(dst: Path) -> bool:
    return dst.exists() and any(dst.glob(".model-*.partial"))


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
    bad_signals = [s for s in signals if s["delivered"] and (s["exit_status"] != 2 or "--resume" not in s["stderr"]
                                                               or not s["identical"] or s["leftovers"])]
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
    """The tables docs/reliability.md quotes: kill points per phase and strategy, signals, fuzzing."""
    lines = [f"Command: `{report['command']}` (commit {report['commit']}, {report['machine']['cpus']} CPUs, "
             f"{report['seconds']} s)", ""]
    for recipe, result in report["recipes"].items():
        lines += [f"**{recipe}** ({report['preset']} preset: {result['output_shards']} output shards, "
                  f"{result['output_bytes']} bytes, uninterrupted run {result['reference_seconds']} s)", "",
                  "| phase | strategy | kill points | killed | identical after resume | torn files | bytes lost |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        groups: dict[tuple[str, str], list[dict]] = {}
        for o in result["outcomes"]:
            groups.setdefault((o["phase"], o["strategy"]), []).append(o)
        for (phase, strategy), rows in groups.items():
            lines.append(f"| {phase} | {strategy} | {len(rows)} | {sum(r['killed'] for r in rows)} | "
                         f"{sum(r['identical'] for r in rows)} | {sum(len(r['problems_after_kill']) for r in rows)} | "
                         f"{sum(r['bytes_lost'] for r in rows)} |")
        failed = [o for o in result["outcomes"] if not o["identical"]]
        lines += [""] + [f"- not identical: {o['point']}: {o['diffs'][0][:200]}" for o in failed]
        lines += ["", "| signal | delivered when | exit | stderr | leftovers | identical after resume |",
                  "|---|---|---:|---|---|---|"]
        for sig in result["signals"]:
            lines.append(f"| {sig['signal']} | {sig['when']}{'' if sig['delivered'] else ' (run had finished)'} | "
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
