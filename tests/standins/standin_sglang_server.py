"""STAND-IN for an SGLang server or router, used only by the serve tests (loopback only).

Serves, like SGLang 0.5.23's endpoints:

* ``GET /health`` (503 until ready, then 200);
* ``POST /generate``: a fixed answer, plus ``meta_info.indexer_topk`` as base64 int32 when
  ``return_indexer_topk`` is requested, and, when started with ``--speculative-algorithm``, the
  speculative-decoding fields SGLang's ``TokenizerManager._calculate_spec_decoding_metrics``
  puts into ``meta_info`` (``spec_verify_ct``, ``spec_accept_length`` = completion tokens /
  verify steps, ``spec_accept_rate`` = correct drafts / proposed drafts, ...);
* ``GET /server_info``: ``internal_states[i].avg_spec_accept_length`` as SGLang's
  ``InternalStateManager._add_speculative`` reports it (accepted tokens / forward steps, over
  every request the server has answered);
* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI-compatible, generation
  only): the reply is the entry of ``--canned-answers`` whose ``match`` text occurs last in the
  prompt (the chat's last user turn, or the completion prompt, token ids decoded with the
  model's ``tokenizer.json`` from ``--tokenizer``).

It accepts a whole ``sglang.launch_server`` argv and reads only ``--port`` and the speculative
flags from it, so a test can start it with the arguments ``serve`` planned. Behaviours simulate
failures: start-up failure, never healthy, or a crash (exit without answering) on the request
after ``--die-after-requests`` OpenAI requests. With ``--child-pid-file`` it first spawns a
long-lived child process (in the stand-in's process group, like SGLang's scheduler processes),
so tests can prove that stopping reaches grandchildren too.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

ANSWER = " stand-in answer"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)  # SGLang's flags must never match ours by prefix
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--behaviour", choices=("ok", "die-on-start", "never-healthy"), default="ok")
    parser.add_argument("--ready-after", type=float, default=0.3)
    parser.add_argument("--indexer-layers", type=int, default=3)
    parser.add_argument("--index-topk", type=int, default=8)
    parser.add_argument("--child-pid-file")
    parser.add_argument("--missing-weight", help="log SGLang's warning for a parameter with no checkpoint tensor")
    parser.add_argument("--canned-answers", type=Path, help='JSON: {"answers": [{"match": ..., "reply": ...}], "default": ...}')
    parser.add_argument("--tokenizer", type=Path, help="directory with tokenizer.json, to decode token-id prompts")
    parser.add_argument("--die-after-requests", type=int, help="exit (status 7) instead of answering the next OpenAI request")
    parser.add_argument("--spec-accept-rate", type=float, default=0.0,
                        help="fraction of proposed draft tokens accepted (with --speculative-algorithm)")
    # The SGLang flags this stand-in understands; every other launch_server flag is ignored.
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    parser.add_argument("--speculative-dspark-block-size", type=int)
    args, _ = parser.parse_known_args(argv)
    return args


class CannedAnswers:
    """Replies picked by the question they answer: the match that occurs last in the prompt wins."""

    def __init__(self, path: Path | None):
        table = json.loads(path.read_text()) if path else {"answers": [], "default": ANSWER}
        self.answers = [(entry["match"], entry["reply"]) for entry in table["answers"]]
        self.default = table.get("default", ANSWER)

    def reply(self, prompt: str) -> str:
        best, position = self.default, -1
        for match, reply in self.answers:
            found = prompt.rfind(match)
            if found > position:
                best, position = reply, found
        return best


class SpecCounters:
    """Speculative-decoding statistics as SGLang computes them, for a fixed acceptance rate."""

    def __init__(self, draft_tokens: int, accept_rate: float):
        self.proposed_per_step = draft_tokens - 1
        self.accept_rate = accept_rate
        self.total_tokens = 0
        self.total_steps = 0
        self.lock = threading.Lock()

    def meta_info(self, completion_tokens: int) -> dict:
        # Each verify step yields its accepted drafts plus one bonus token.
        steps = max(1, math.ceil(completion_tokens / (1 + self.accept_rate * self.proposed_per_step)))
        correct = min(completion_tokens - steps, steps * self.proposed_per_step)
        with self.lock:
            self.total_tokens += completion_tokens
            self.total_steps += steps
        proposed = steps * self.proposed_per_step
        # Steps that accepted k drafts (SGLang's spec_correct_drafts_histogram): the drafts spread as evenly
        # over the steps as whole counts allow.
        low, extra = divmod(correct, steps)
        histogram = [0] * (low + 2)
        histogram[low], histogram[low + 1] = steps - extra, extra
        return {
            "spec_correct_drafts_histogram": histogram[:-1] if extra == 0 else histogram,
            "spec_accept_rate": correct / proposed,
            "spec_accept_length": completion_tokens / steps,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_verify_ct": steps,
        }

    def server_state(self) -> dict:
        with self.lock:
            return {"avg_spec_accept_length": self.total_tokens / self.total_steps} if self.total_steps else {}


def main() -> int:
    args = parse_args(sys.argv[1:])
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
    canned = CannedAnswers(args.canned_answers)
    tokenizer = None
    if args.tokenizer:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    # DSPARK verifies its block and the anchor (speculative_hook.py::_handle_dspark); EAGLE its draft tokens.
    draft_tokens = (args.speculative_dspark_block_size + 1 if args.speculative_algorithm == "DSPARK"
                    else args.speculative_num_draft_tokens or 2)
    spec = SpecCounters(draft_tokens, args.spec_accept_rate) if args.speculative_algorithm else None
    openai_requests = {"count": 0}
    counter_lock = threading.Lock()
    started = time.monotonic()

    def decode(prompt: object) -> str:
        if isinstance(prompt, str):
            return prompt
        if tokenizer is None:
            raise ValueError("token-id prompt but the stand-in has no --tokenizer")
        return tokenizer.decode(list(prompt), skip_special_tokens=False)

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
            elif self.path in ("/server_info", "/get_server_info"):
                self._send(200, {"internal_states": [spec.server_state() if spec else {}], "version": "stand-in"})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:  # noqa: N802 - http.server API
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/generate":
                self._generate(request)
            elif self.path in ("/v1/chat/completions", "/v1/completions"):
                with counter_lock:
                    if args.die_after_requests is not None and openai_requests["count"] >= args.die_after_requests:
                        print("stand-in: simulated crash while serving", flush=True)
                        os._exit(7)
                    openai_requests["count"] += 1
                if self.path == "/v1/chat/completions":
                    self._chat(request)
                else:
                    self._completions(request)
            else:
                self._send(404, {"error": self.path})

        def _generate(self, request: dict) -> None:
            sampling = request.get("sampling_params") or {}
            meta = {"prompt_tokens": len(request.get("input_ids") or []),
                    "completion_tokens": int(sampling.get("max_new_tokens", 16))}
            if request.get("return_indexer_topk"):
                rows = max(meta["prompt_tokens"], 2) - 1
                topk = np.arange(rows * args.indexer_layers * args.index_topk, dtype="<i4")
                meta["indexer_topk"] = base64.b64encode(topk.tobytes()).decode()
            if spec is not None:
                meta.update(spec.meta_info(meta["completion_tokens"]))
            self._send(200, {"text": ANSWER, "meta_info": meta})

        def _chat(self, request: dict) -> None:
            users = [m["content"] for m in request.get("messages", []) if m.get("role") == "user"]
            reply = canned.reply(users[-1] if users else "")
            self._send(200, {"id": "chatcmpl-standin", "object": "chat.completion", "created": int(time.time()),
                             "model": request.get("model"),
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                          "finish_reason": "stop"}]})

        def _completions(self, request: dict) -> None:
            if request.get("echo") or request.get("logprobs"):
                self._send(400, {"error": "stand-in: prompt logprobs are not simulated"})
                return
            prompt = request.get("prompt")
            batch = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
            try:
                texts = [decode(p) for p in batch]
            except ValueError as exc:
                self._send(400, {"error": str(exc)})
                return
            self._send(200, {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                             "model": request.get("model"),
                             "choices": [{"index": i, "text": canned.reply(t), "finish_reason": "stop", "logprobs": None}
                                         for i, t in enumerate(texts)]})

        def log_message(self, format: str, *values: object) -> None:  # noqa: A002
            print(f"stand-in: {format % values}", flush=True)

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
