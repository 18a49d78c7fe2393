"""STAND-IN driver for the Ctrl-C test: runs ``serve``'s start/wait/hold path on stand-in servers.

argv: PID_FILE PORT...; one stand-in per port (the last acts as the router). Once all are
healthy it writes the process-group ids, one per line, to PID_FILE, then holds like ``serve``
until interrupted, exiting 130 as the dsv4convert CLI does on Ctrl-C.
"""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

from dsv4convert.serve.cli import _hold, start_and_wait
from dsv4convert.serve.launch import Command
from dsv4convert.serve.process import ProcessGroup

STANDIN = Path(__file__).with_name("standin_sglang_server.py")


def main() -> int:
    # Ctrl-C as in a terminal, whatever the test runner was started with: a job a shell puts in the
    # background inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    pid_file, ports = Path(sys.argv[1]), [int(p) for p in sys.argv[2:]]
    roles = ["prefill", "decode", "router", "server"]
    commands = [
        Command(roles[i] if i < len(ports) - 1 else "router",
                (sys.executable, str(STANDIN), "--port", str(port), "--child-pid-file", f"{pid_file}.child{i}"),
                {}, f"http://127.0.0.1:{port}", (port,))
        for i, port in enumerate(ports)
    ]
    try:
        with ProcessGroup(Path(tempfile.mkdtemp(prefix="standin-logs-")), stop_grace=2.0) as group:
            start_and_wait(group, commands, timeout=120.0)
            pid_file.write_text("\n".join(str(p.popen.pid) for p in group.processes))
            _hold(group)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
