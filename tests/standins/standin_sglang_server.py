"""STAND-IN for an SGLang server or router, used only by the serve lifecycle tests (loopback only).

Serves ``GET /health`` (503 until ready, then 200) and ``POST /generate`` (a fixed answer, plus
``meta_info.indexer_topk`` as base64 int32 when ``return_indexer_topk`` is requested), like
SGLang 0.5.23's native endpoints. Behaviours simulate start-up failures. With ``--child-pid-file``
it first spawns a long-lived child process (in the stand-in's process group, like SGLang's
scheduler processes), so tests can prove that stopping reaches grandchildren too.
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

ANSWER = " stand-in answer"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--behaviour", choices=("ok", "die-on-start", "never-healthy"), default="ok")
    parser.add_argument("--ready-after", type=float, default=0.3)
    parser.add_argument("--indexer-layers", type=int, default=3)
    parser.add_argument("--index-topk", type=int, default=8)
    parser.add_argument("--child-pid-file")
    parser.add_argument("--missing-weight", help="log SGLang's warning for a parameter with no checkpoint tensor")
    args = parser.parse_args()

    print(f"stand-in: starting on 127.0.0.1:{args.port} ({args.behaviour})", flush=True)
    if args.child_pid_file:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(args.child_pid_file, "w") as handle:
            handle.write(str(child.pid))
    if args.missing_weight:
        print(f"Some weights are not initialized from checkpoints: {{'{args.missing_weight}'}}", flush=True)
    if args.behaviour == "die-on-start":
        time.sleep(0.2)
        print("stand-in: simulated start-up failure (CUDA out of memory)", flush=True)
        return 3
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server API
            ready = args.behaviour == "ok" and time.monotonic() - started >= args.ready_after
            if self.path == "/health":
                self._send(200 if ready else 503, {})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            if self.path != "/generate":
                self._send(404, {"error": self.path})
                return
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            meta = {"prompt_tokens": len(request.get("input_ids") or [])}
            if request.get("return_indexer_topk"):
                rows = max(meta["prompt_tokens"], 2) - 1
                topk = np.arange(rows * args.indexer_layers * args.index_topk, dtype="<i4")
                meta["indexer_topk"] = base64.b64encode(topk.tobytes()).decode()
            self._send(200, {"text": ANSWER, "meta_info": meta})

        def log_message(self, format: str, *values: object) -> None:  # noqa: A002
            print(f"stand-in: {format % values}", flush=True)

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
