"""Serve failures that tests/test_serve_process.py does not reach: a server killed after it became
healthy, a router that never turns healthy or finds its port taken once the servers run, and a
server SIGKILLed while starting that leaves its own child behind. In every case each process
started is stopped (grandchildren included), every port is free again, and the error shows the
log tail of the process that failed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading

import pytest

from dsv4convert.serve.cli import smoke_request, start_and_wait
from dsv4convert.serve.process import ProcessGroup, ServeError
from test_serve_process import STARTUP_TIMEOUT, assert_nothing_left, free_port, pid_alive, standin, wait_until


def pd_commands(tmp_path, ports, router_extra=()):
    files = [tmp_path / f"child-{role}" for role in ("prefill", "decode", "router")]
    commands = [standin("prefill", ports[0], "--child-pid-file", str(files[0])),
                standin("decode", ports[1], "--child-pid-file", str(files[1])),
                standin("router", ports[2], "--child-pid-file", str(files[2]), *router_extra)]
    return commands, files


@contextlib.contextmanager
def pd_group_with_one_killed(tmp_path, index: int):
    """Stand-in PD servers, all healthy, then SIGKILL to the leader of server ``index`` only (the
    OOM killer's way: its own child lives on in the process group). Yields the group, the commands
    and the child pids; once the group is left, every process, port and child must be gone,
    whatever was raised."""
    ports = [free_port() for _ in range(3)]
    commands, files = pd_commands(tmp_path, ports)
    pgids, children = [], []
    try:
        with ProcessGroup(tmp_path / "logs", stop_grace=2.0, echo=lambda line: None) as group:
            start_and_wait(group, commands, timeout=STARTUP_TIMEOUT)
            pgids += [p.popen.pid for p in group.processes]
            children += [int(f.read_text()) for f in files]
            victim = group.processes[index]
            os.kill(victim.popen.pid, signal.SIGKILL)
            assert wait_until(lambda: victim.popen.poll() is not None)
            yield group, commands, children
    finally:
        assert_nothing_left(pgids, ports, children)


def test_server_killed_after_it_was_healthy(tmp_path):
    """The router's leader is killed: its child still holds resources inside the group; the next
    request fails as a ServeError and leaving the group stops the rest."""
    with pd_group_with_one_killed(tmp_path, 2) as (_, commands, children):
        assert pid_alive(children[2])  # orphaned inside the group, still holding resources
        with pytest.raises(ServeError, match=rf"POST {re.escape(commands[2].url)}/generate failed"):
            smoke_request(commands[2].url, timeout=5.0)


def test_router_never_healthy_stops_the_servers_too(tmp_path):
    ports = [free_port() for _ in range(3)]
    commands, files = pd_commands(tmp_path, ports, ("--behaviour", "never-healthy"))
    started: list[str] = []
    with pytest.raises(ServeError, match=r"(?s)router not healthy at http://127.0.0.1:\d+/health after 3 s.*"
                                         r"stand-in: starting on .* \(never-healthy\)"):
        with ProcessGroup(tmp_path / "logs", stop_grace=2.0, echo=started.append) as group:
            servers = [group.start(c) for c in commands[:2]]
            for running in servers:
                group.wait_healthy(running, timeout=STARTUP_TIMEOUT, poll=0.1)
            router = group.start(commands[2])
            log = tmp_path / "logs" / "router.log"   # the tail must not race the router's interpreter start-up
            assert wait_until(lambda: log.exists() and "stand-in: starting" in log.read_text()), "no router start"
            group.wait_healthy(router, timeout=3.0, poll=0.2)
    pgids = [int(line.split("pid ")[1].split(")")[0]) for line in started if line.startswith("started")]
    assert len(pgids) == 3
    assert_nothing_left(pgids, ports, [int(f.read_text()) for f in files])


def test_router_port_taken_after_the_servers_started(tmp_path):
    ports = [free_port() for _ in range(2)]
    started: list[str] = []
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        router_port = squatter.getsockname()[1]
        commands, files = pd_commands(tmp_path, [*ports, router_port])
        with pytest.raises(ServeError, match=rf"cannot start router: port\(s\) {router_port} already in use"):
            with ProcessGroup(tmp_path / "logs", stop_grace=2.0, echo=started.append) as group:
                start_and_wait(group, commands, timeout=STARTUP_TIMEOUT)
    pgids = [int(line.split("pid ")[1].split(")")[0]) for line in started if line.startswith("started")]
    assert len(pgids) == 2 and not (tmp_path / "logs" / "router.log").exists()
    assert_nothing_left(pgids, ports, [int(f.read_text()) for f in files[:2]])


def test_server_sigkilled_while_starting_leaves_no_child_behind(tmp_path):
    port = free_port()
    child_file = tmp_path / "child"
    command = standin("decode", port, "--child-pid-file", str(child_file), "--ready-after", "60")
    with pytest.raises(ServeError, match=r"(?s)decode exited with status -9 while starting; last lines of .*decode\.log"
                                         r".*stand-in: starting"):
        with ProcessGroup(tmp_path / "logs", stop_grace=1.0, echo=lambda line: None) as group:
            running = group.start(command)
            pgid = running.popen.pid
            assert wait_until(lambda: child_file.exists() and child_file.read_text(), timeout=STARTUP_TIMEOUT)
            # Killed while waiting (the stand-in is not ready for 60 s): the error must be its death, not
            # the timeout; the match above tells the two apart, so no clock is read.
            threading.Timer(0.5, os.kill, (pgid, signal.SIGKILL)).start()
            group.wait_healthy(running, timeout=STARTUP_TIMEOUT, poll=0.1)
    assert_nothing_left([pgid], [port], [int(child_file.read_text())])
