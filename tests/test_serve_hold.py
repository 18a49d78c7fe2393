"""While serving, `serve` watches its servers: one that dies ends the run with its log tail."""

from __future__ import annotations

import pytest

from dsv4convert.serve.cli import _hold
from dsv4convert.serve.process import ServeError
from test_reliability_serve import pd_group_with_one_killed


def test_a_server_that_dies_while_serving_stops_the_run_with_its_log(tmp_path):
    with pytest.raises(ServeError, match=r"(?s)decode exited with status -9 while serving; last lines of .*decode\.log"):
        with pd_group_with_one_killed(tmp_path, 1) as (group, _, _):
            _hold(group)
