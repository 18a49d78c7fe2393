"""Start, watch and stop the serving processes, leaving nothing behind.

Each process runs in its own session (so its process group holds all of its children, e.g.
SGLang's scheduler and detokenizer) with stdout/stderr in a log file. Stopping signals the
whole group, first SIGTERM, then SIGKILL after a grace period, and waits for every member, so
Ctrl-C or any failure leaves no orphan and no port held.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, TYPE_CHECKING, Any

from dsv4convert.errors import DSV4Error

if TYPE_CHECKING:   # only named in annotations: `serve --help` loads this module without the launch rules
    from dsv4convert.serve.launch import Command

LOG_TAIL_LINES = 40


class ServeError(DSV4Error):
    """A serving process failed to start, never became healthy, or a request through it failed."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log written)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(log is empty)"


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server could bind ``host:port`` now.

    SO_REUSEADDR as servers set it (uvicorn, the router): connections lingering in TIME_WAIT
    after a stop do not hold a port, a listening socket does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def http_get(url: str, timeout: float) -> int:
    """HTTP status of a GET, or 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def http_get_json(url: str, timeout: float) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServeError(f"GET {url} returned HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as exc:
        raise ServeError(f"GET {url} failed: {exc}") from exc


def http_post_json(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServeError(f"POST {url} returned HTTP {exc.code}: {exc.read()[:500]!r}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise ServeError(f"POST {url} failed: {exc}") from exc


@dataclass
class RunningProcess:
    command: Command
    popen: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]

    @property
    def name(self) -> str:
        return self.command.role


class ProcessGroup:
    """The processes of one ``serve`` run; a context manager that always stops them all."""

    def __init__(self, log_dir: Path, *, stop_grace: float = 10.0, echo: Callable[[str], None] = print):
        self.log_dir = log_dir
        self.stop_grace = stop_grace
        self.echo = echo
        self.processes: list[RunningProcess] = []
        self._previous_sigterm: Any = None

    def __enter__(self) -> ProcessGroup:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()
        signal.signal(signal.SIGTERM, self._previous_sigterm)

    def start(self, command: Command) -> RunningProcess:
        """Start one command in its own session after checking that its ports are free."""
        busy = [port for port in command.ports if not port_is_free(port)]
        if busy:
            raise ServeError(f"cannot start {command.role}: port(s) {', '.join(map(str, busy))} already in use")
        log_path = self.log_dir / f"{command.role}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop_all
        log_file.write(f"$ {command.shell()}\n".encode())
        log_file.flush()
        try:
            popen = subprocess.Popen(
                list(command.argv),
                env={**os.environ, **command.env},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            log_file.close()
            raise ServeError(f"cannot start {command.role} ({command.argv[0]}): {exc}") from exc
        running = RunningProcess(command, popen, log_path, log_file)
        self.processes.append(running)
        self.echo(f"started {command.role} (pid {popen.pid}), log: {log_path}")
        return running

    def wait_healthy(self, running: RunningProcess, timeout: float, poll: float = 1.0, path: str = "/health") -> float:
        """Poll ``GET url+path`` until 200; fail early, with the log tail, if the process dies."""
        url = running.command.url + path
        start = time.monotonic()
        while True:
            code = running.popen.poll()
            if code is not None:
                raise ServeError(
                    f"{running.name} exited with status {code} while starting; last lines of {running.log_path}:\n"
                    f"{log_tail(running.log_path)}"
                )
            if http_get(url, timeout=max(poll, 1.0)) == 200:
                elapsed = time.monotonic() - start
                self.echo(f"{running.name} healthy after {elapsed:.1f} s ({url})")
                return elapsed
            if time.monotonic() - start > timeout:
                raise ServeError(
                    f"{running.name} not healthy at {url} after {timeout:.0f} s; last lines of {running.log_path}:\n"
                    f"{log_tail(running.log_path)}"
                )
            time.sleep(poll)

    def run_client(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        poll: float = 0.5,
        progress: Callable[[], None] = lambda: None,
    ) -> int:
        """Run a client of the servers (an evaluation, a benchmark) to its end and return its exit status.

        The client gets its own session and log. While it runs, the servers are watched: if one
        dies, the client is stopped at once and the server's death is the error (with its log
        tail), since whatever the client reports afterwards is a consequence. Whatever happens
        (Ctrl-C included) the client's whole process group is gone when this returns or raises.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log_file:
            log_file.write(f"$ {shlex.join(argv)}\n".encode())
            log_file.flush()
            try:
                client = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                          stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                raise ServeError(f"cannot start {name} ({argv[0]}): {exc}") from exc
            self.echo(f"started {name} (pid {client.pid}), log: {log_path}")
            try:
                while True:
                    code = client.poll()
                    if code == 0:
                        return 0
                    dead = next((p for p in self.processes if p.popen.poll() is not None), None)
                    if dead is not None:
                        raise ServeError(
                            f"{dead.name} exited with status {dead.popen.poll()} while {name} was running; last lines "
                            f"of {dead.log_path}:\n{log_tail(dead.log_path)}")
                    if code is not None:
                        return code
                    progress()
                    time.sleep(poll)
            finally:
                _stop_client(client, self.stop_grace)

    def stop_all(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period, reap all."""
        for running in reversed(self.processes):
            _signal_group(running.popen, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        for running in reversed(self.processes):
            try:
                running.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        survivors = []
        for running in reversed(self.processes):
            # The leader may be gone while children of its group live on: always sweep the group.
            _signal_group(running.popen, signal.SIGKILL)
            running.popen.wait()
            running.log_file.close()
            if not _wait_group_gone(running.popen.pid):
                survivors.append(f"{running.name} (process group {running.popen.pid})")
        self.processes.clear()
        if survivors:
            raise ServeError(f"processes survived SIGKILL: {', '.join(survivors)}")


def _stop_client(popen: subprocess.Popen, grace: float) -> None:
    """SIGTERM a client's process group, SIGKILL it after ``grace`` seconds, reap it."""
    if popen.poll() is None:
        _signal_group(popen, signal.SIGTERM)
        try:
            popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(popen, signal.SIGKILL)
    popen.wait()
    if not _wait_group_gone(popen.pid):
        raise ServeError(f"client process group {popen.pid} survived SIGKILL")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _signal_group(popen: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


def live_processes() -> list[tuple[int, int, int]]:
    """``(pid, parent pid, process group)`` of every running process (zombies excluded), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # the command name may hold spaces
        except OSError:
            continue
        if fields[0] != "Z":
            found.append((int(stat.parent.name), int(fields[1]), int(fields[2])))
    return found


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are still running."""
    return [pid for pid, _, group in live_processes() if group == pgid]


def _wait_group_gone(pgid: int, timeout: float = 5.0) -> bool:
    """Wait until no live process is left in group ``pgid`` (SIGKILL is asynchronous); False if some stay."""
    deadline = time.monotonic() + timeout
    while live_group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
