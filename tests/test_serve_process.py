"""Serve lifecycle against stand-in servers (tests/standins/): readiness, failures, Ctrl-C, no leftovers."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsv4convert.serve.cli import smoke_request, start_and_wait
from dsv4convert.serve.launch import Command
from dsv4convert.serve.process import ProcessGroup, ServeError, live_group_members, port_is_free

STANDINS = Path(__file__).with_name("standins")
STANDIN_SERVER = STANDINS / "standin_sglang_server.py"
REPO = Path(__file__).resolve().parents[1]
# Bounds on a hang, not measurements: a stand-in is healthy well under a second after it starts, but
# CI's 2-core machine may be busy, and a bound only ever decides how long a broken run takes to fail.
STARTUP_TIMEOUT = 120.0
EXIT_TIMEOUT = 60.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def standin(role: str, port: int, *extra: str) -> Command:
    argv = (sys.executable, str(STANDIN_SERVER), "--port", str(port), *extra)
    return Command(role, argv, {"STANDIN_ROLE": role}, f"http://127.0.0.1:{port}", (port,))


def pid_alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate, timeout: float = EXIT_TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def assert_nothing_left(pgids: list[int], ports: list[int], child_pids: list[int] = ()) -> None:
    assert all(not live_group_members(g) for g in pgids), [live_group_members(g) for g in pgids]
    assert all(not pid_alive(p) for p in child_pids)
    assert all(port_is_free(p) for p in ports)


def test_pd_readiness_then_request_through_router(tmp_path):
    ports = [free_port() for _ in range(3)]
    child_pid_files = [tmp_path / f"child{i}" for i in range(3)]
    commands = [standin(role, port, "--child-pid-file", str(pid_file))
                for role, port, pid_file in zip(("prefill", "decode", "router"), ports, child_pid_files)]
    with ProcessGroup(tmp_path / "logs", stop_grace=2.0, echo=lambda line: None) as group:
        start_and_wait(group, commands, timeout=STARTUP_TIMEOUT)
        assert [p.name for p in group.processes] == ["prefill", "decode", "router"]
        assert smoke_request(commands[-1].url, timeout=EXIT_TIMEOUT) == " stand-in answer"
        pgids = [p.popen.pid for p in group.processes]
        children = [int(f.read_text()) for f in child_pid_files]
        assert all(pid_alive(c) for c in children)
        assert (tmp_path / "logs" / "prefill.log").read_text().startswith("$ STANDIN_ROLE=prefill ")
    assert_nothing_left(pgids, ports, children)


def test_uninitialized_weights_are_reported(tmp_path):
    ports = [free_port(), free_port()]
    echoed: list[str] = []
    with ProcessGroup(tmp_path / "logs", stop_grace=1.0, echo=echoed.append) as group:
        start_and_wait(group, [standin("prefill", ports[0]),
                               standin("decode", ports[1], "--missing-weight", "model.layers.3.mlp.experts.w13_input_scale")],
                       STARTUP_TIMEOUT)
    warnings = [line for line in echoed if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: decode: Some weights are not initialized")
    assert "w13_input_scale" in warnings[0]


def test_process_dying_during_startup_reports_log_tail(tmp_path):
    port = free_port()
    with pytest.raises(ServeError, match=r"(?s)prefill exited with status 3.*simulated start-up failure"):
        with ProcessGroup(tmp_path / "logs", stop_grace=1.0, echo=lambda line: None) as group:
            group.wait_healthy(group.start(standin("prefill", port, "--behaviour", "die-on-start")),
                              timeout=STARTUP_TIMEOUT, poll=0.1)
    assert port_is_free(port)


def test_health_that_never_turns_green_times_out_and_cleans_up(tmp_path):
    """The message gives the timeout asked for and the log's tail; the elapsed time is only checked against a hang.

    The health wait starts once the stand-in has said it is starting: on a busy machine its interpreter can take
    longer than the 1.5 s timeout to print anything, and the tail must not depend on that race."""
    port = free_port()
    with pytest.raises(ServeError, match=r"(?s)decode not healthy at http://127.0.0.1:\d+/health after 2 s.*stand-in: starting"):
        with ProcessGroup(tmp_path / "logs", stop_grace=1.0, echo=lambda line: None) as group:
            running = group.start(standin("decode", port, "--behaviour", "never-healthy"))
            pgid = running.popen.pid
            log = tmp_path / "logs" / "decode.log"
            assert wait_until(lambda: "stand-in: starting" in log.read_text()), "the stand-in never started"
            start = time.monotonic()
            group.wait_healthy(running, timeout=1.5, poll=0.2)
    assert time.monotonic() - start < EXIT_TIMEOUT, "waiting for health did not stop at its timeout"
    assert_nothing_left([pgid], [port])


def test_port_already_taken_starts_nothing(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(ServeError, match=f"port\\(s\\) {port} already in use"):
            with ProcessGroup(tmp_path / "logs", echo=lambda line: None) as group:
                group.start(standin("router", port))
        assert group.processes == []
        assert not (tmp_path / "logs" / "router.log").exists()


def test_missing_executable_is_a_serve_error(tmp_path):
    port = free_port()
    missing = Command("prefill", ("/nonexistent/numactl", "--cpunodebind=0"), {}, f"http://127.0.0.1:{port}", (port,))
    with pytest.raises(ServeError, match="cannot start prefill"):
        with ProcessGroup(tmp_path / "logs", echo=lambda line: None) as group:
            group.start(missing)
    assert group.processes == []


def test_failure_after_start_stops_servers_already_running(tmp_path):
    good, bad = free_port(), free_port()
    started: list[str] = []
    with pytest.raises(ServeError, match="decode exited with status 3"):
        with ProcessGroup(tmp_path / "logs", stop_grace=1.0, echo=started.append) as group:
            start_and_wait(group, [standin("prefill", good), standin("decode", bad, "--behaviour", "die-on-start")],
                           STARTUP_TIMEOUT)
    pgids = [int(re.search(r"pid (\d+)", line).group(1)) for line in started if line.startswith("started")]
    assert len(pgids) == 2 and group.processes == []
    assert_nothing_left(pgids, [good, bad])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_every_process_and_frees_ports(tmp_path, sig):
    ports = [free_port() for _ in range(3)]
    pid_file = tmp_path / "pids"
    driver = subprocess.Popen(
        [sys.executable, str(STANDINS / "standin_serve_driver.py"), str(pid_file), *map(str, ports)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(),
                          timeout=2 * STARTUP_TIMEOUT), driver.stdout.read1()
        pgids = [int(line) for line in pid_file.read_text().split()]
        children = [int(Path(f"{pid_file}.child{i}").read_text()) for i in range(3)]
        assert len(pgids) == 3 and all(live_group_members(g) for g in pgids)
        assert not any(port_is_free(p) for p in ports)
        driver.send_signal(sig)
        assert driver.wait(timeout=EXIT_TIMEOUT) == 130
    finally:
        if driver.poll() is None:
            driver.kill()
    assert_nothing_left(pgids, ports, children)
