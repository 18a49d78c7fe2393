"""While serving, `serve` watches its servers: one that dies ends the run with its log tail."""

from __future__ import annotations

import os
import signal

import pytest

from dsv4convert.serve.cli import _hold, start_and_wait
from dsv4convert.serve.process import ProcessGroup, ServeError
from test_reliability_serve import pd_commands
from test_serve_process import assert_nothing_left, free_port, wait_until


def test_a_server_that_dies_while_serving_stops_the_run_with_its_log(tmp_path):
    ports = [free_port() for _ in range(3)]
    commands, files = pd_commands(tmp_path, ports)
    with pytest.raises(ServeError, match=r"(?s)decode exited with status -9 while serving; last lines of .*decode\.log"):
        with ProcessGroup(tmp_path / "logs", stop_grace=2.0, echo=lambda line: None) as group:
            start_and_wait(group, commands, timeout=15.0)
            pgids = [p.popen.pid for p in group.processes]
            children = [int(f.read_text()) for f in files]
            decode = group.processes[1]
            os.kill(decode.popen.pid, signal.SIGKILL)
            assert wait_until(lambda: decode.popen.poll() is not None)
            _hold(group)
    assert_nothing_left(pgids, ports, children)
