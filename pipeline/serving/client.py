"""Talking to a running vLLM: greedy completions on token ids, and the spec-decode counters of
/metrics (docs/reference.md §2.6: difference two scrapes, sum over engines, skip *_created)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import count, zip_longest

from prometheus_client.parser import text_string_to_metric_families

from pipeline.host.httpio import get as http_get
from pipeline.host.httpio import post_events, post_json

SPEC_PREFIX = "vllm:spec_decode_"


def _body(model: str, prompt_ids: list[int], max_tokens: int, fields: dict) -> dict:
    """A greedy request to the server's completions API (token ids in, `fields` added)."""
    return {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, **fields}


def complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int, headers: dict,
             timeout: float = 600) -> dict:
    t0 = time.perf_counter()
    data = post_json(f"{base_url}/v1/completions", _body(model, prompt_ids, max_tokens, {"return_token_ids": True}),
                     headers, timeout)
    choice = data["choices"][0]
    return {"token_ids": choice.get("token_ids"), "text": choice["text"],
            "completion_tokens": data["usage"]["completion_tokens"], "seconds": time.perf_counter() - t0}


def stream_complete(base_url: str, model: str, prompt_ids: list[int], max_tokens: int, headers: dict,
                    timeout: float = 600, extra: dict | None = None) -> dict:
    """`complete`, streamed: the same greedy tokens plus when each arrived. Each server-sent chunk carries
    the tokens of one engine step (one with plain decoding, up to k + 1 with a draft), so the client sees
    the first token's wait (`ttft`) apart from the decode that follows (`decode_seconds`, `chunks`) — the
    split vLLM's own benchmark reports as TTFT and TPOT."""
    body = _body(model, prompt_ids, max_tokens, {"return_token_ids": True, "stream": True,
                                                 "stream_options": {"include_usage": True}, **(extra or {})})
    t0 = time.perf_counter()
    tokens: list[int] = []
    text: list[str] = []
    usage: dict | None = None
    first: float | None = None
    last, chunks, first_tokens = 0.0, 0, 0
    for event in post_events(f"{base_url}/v1/completions", body, headers, timeout):
        if "error" in event or event.get("object") == "error":  # vLLM failed mid-answer: not an answer
            error = event.get("error", event)
            raise RuntimeError(f"the server ended the stream with an error: "
                               f"{error.get('message', error) if isinstance(error, dict) else error}")
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices") or ():
            delta = choice.get("token_ids") or []
            text.append(choice.get("text") or "")
            if delta:
                now = time.perf_counter()
                if first is None:
                    first, first_tokens = now, len(delta)
                last, chunks = now, chunks + 1
                tokens += delta
    return {"token_ids": tokens, "text": "".join(text),
            "completion_tokens": usage["completion_tokens"] if usage else len(tokens),
            "seconds": time.perf_counter() - t0, "ttft": (first - t0) if first is not None else None,
            "decode_seconds": (last - first) if first is not None else 0.0, "chunks": chunks,
            "first_tokens": first_tokens}


def top_logprobs(base_url: str, model: str, prompt_ids: list[int], headers: dict, n: int = 2,
                 timeout: float = 600) -> list[tuple[int, float]]:
    """The served model's n most likely next tokens after `prompt_ids` as (token id, logprob), best first
    (vLLM's completions API with `return_tokens_as_token_ids`: keys read "token_id:123")."""
    data = post_json(f"{base_url}/v1/completions",
                     _body(model, prompt_ids, 1, {"logprobs": n, "return_tokens_as_token_ids": True}), headers, timeout)
    top = data["choices"][0]["logprobs"]["top_logprobs"][0]
    return sorted(((int(key.rsplit(":", 1)[1]), float(lp)) for key, lp in top.items()), key=lambda kv: -kv[1])


@dataclass(frozen=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple = ()

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        per_position = zip_longest(self.per_position, other.per_position, fillvalue=0.0)
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, tuple(x - y for x, y in per_position))

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    def per_position_rate(self) -> list[float]:
        return [p / self.drafts if self.drafts else 0.0 for p in self.per_position]


def _samples(text: str):
    """Every sample of a /metrics page as (name, labels, value), read by prometheus_client's own parser;
    `*_created` samples (a counter's creation time, not a count) are left out."""
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    yield sample.name, sample.labels, sample.value
    except ValueError as exc:  # the parser stops at a line it cannot read: say which, not a traceback
        raise RuntimeError(f"vLLM's /metrics page is not Prometheus text: {exc}") from None


def parse_spec_counters(text: str) -> SpecCounters:
    """vLLM's spec-decode counters, summed over engines (docs/reference.md §2.6)."""
    sums = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for full, labels, value in _samples(text):
        if not full.startswith(SPEC_PREFIX):
            continue
        name = full[len(SPEC_PREFIX):].removesuffix("_total")
        if name == "num_accepted_tokens_per_pos" and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        elif name in sums:
            sums[name] += value
    return SpecCounters(sums["num_drafts"], sums["num_draft_tokens"], sums["num_accepted_tokens"],
                        tuple(per_pos[i] for i in sorted(per_pos)))


def scrape(base_url: str) -> SpecCounters:
    code, text = http_get(f"{base_url}/metrics", timeout=10)
    if code != 200:
        raise RuntimeError(f"GET {base_url}/metrics answered {code}")
    return parse_spec_counters(text)


def send_all(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
             on_done=lambda n: None, headers: dict | None = None, min_tokens: int = 0) -> dict:
    """All prompts at `concurrency` requests in flight, streamed; outputs in prompt order. `headers`:
    production's key; the run's own servers are internal, loopback and keyless (vllm_modes.server_env).
    Per request averages: `tpot_ms` the request's time per output token (its first token's wait included:
    what the speedup is of), `ttft_ms` the first token's wait, `decode_tpot_ms` the time per token after
    it, `chunk_ms` the time between two chunks of tokens (a decode step, as the client sees it).
    `min_tokens`: vLLM holds the end of text back until each answer has that many tokens."""
    done = count(1)

    def one(ids):
        out = stream_complete(base_url, model, ids, max_tokens, headers or {},
                              extra={"min_tokens": min_tokens} if min_tokens else None)
        on_done(next(done))
        return out

    t0 = time.perf_counter()
    results = in_threads(one, prompts, concurrency)
    seconds = time.perf_counter() - t0
    tokens = sum(r["completion_tokens"] for r in results)
    return {"outputs": [r["token_ids"] for r in results], "output_tokens": tokens, "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 2) if seconds else 0.0, **stream_figures(results)}


def stream_figures(results: list[dict]) -> dict:
    """Per request averages of `stream_complete` answers (send_all's docstring says what each is)."""
    return {"tpot_ms": _mean_ms(r["seconds"] / r["completion_tokens"] for r in results if r["completion_tokens"]),
            "ttft_ms": _mean_ms(r["ttft"] for r in results if r["ttft"] is not None),
            "decode_tpot_ms": _mean_ms(r["decode_seconds"] / (len(r["token_ids"]) - r["first_tokens"])
                                       for r in results if len(r["token_ids"]) > r["first_tokens"]),
            "chunk_ms": _mean_ms(r["decode_seconds"] / (r["chunks"] - 1) for r in results if r["chunks"] > 1)}


def _mean_ms(seconds) -> float | None:
    values = list(seconds)
    return round(1000 * sum(values) / len(values), 3) if values else None


def in_threads(fn, items: list, workers: int, wait_on_error: bool = False) -> list:
    """fn over items in `workers` threads, results in order. Interrupted (SIGTERM) or failed, it returns at
    once without waiting for the calls in flight (requests: their server is stopped next, which ends them) —
    or, `wait_on_error`, once they have ended (server starts: a stopping run makes them give up within a
    second, and only then is every server they recorded known)."""
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    try:
        return list(pool.map(fn, items))
    except BaseException:
        pool.shutdown(wait=wait_on_error, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=False)


def _counter(base_url: str, name: str) -> float | None:
    """A counter of /metrics summed over its label sets (engines), e.g. vllm:prompt_tokens_total."""
    code, text = http_get(f"{base_url}/metrics", timeout=2)
    return sum(value for sample, _, value in _samples(text) if sample == name) if code == 200 else None


def prompt_tokens(base_url: str) -> float | None:
    """The server's prompt-token counter on /metrics (None when it cannot be read): it moves when the
    client's first request arrives."""
    return _counter(base_url, "vllm:prompt_tokens_total")


def running_requests(base_url: str) -> float | None:
    """Requests the server is running now (vllm:num_requests_running, summed over engines)."""
    return _counter(base_url, "vllm:num_requests_running")


def sample_running(base_url: str, seconds: float, every: float = 0.5,
                   stop: threading.Event | None = None) -> list[float]:
    """vllm:num_requests_running every `every` s for `seconds` (unreadable samples skipped): the load a
    server carries, as its own /metrics see it."""
    samples: list[float] = []
    end = time.monotonic() + seconds
    stop = stop or threading.Event()
    while time.monotonic() < end and not stop.is_set():
        try:
            if (n := running_requests(base_url)) is not None:
                samples.append(n)
        except (OSError, RuntimeError):
            pass
        stop.wait(every)
    return samples


def generation_tokens(base_url: str) -> float | None:
    """The server's generated-token counter: a server that answers /health but never moves it is stuck."""
    return _counter(base_url, "vllm:generation_tokens_total")


class PromptWindow(threading.Thread):
    """When the server's prompt-token counter first and last moved past where it stood (a reused server has
    answered others already): the first move ends the client's start (imports, the dataset), the last is the
    last prefill; what comes after is the client finishing its files. `check()` from a watcher's own loop, or
    `start()` to poll every 0.25 s until `stop()`."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True, name="prompt-window")
        self.base_url, self.before = base_url, prompt_tokens(base_url) or 0.0
        self.at: float | None = None  # the first move
        self.last: float | None = None
        self.first_count = 0.0  # the counter at the first move (at the last: `before`)
        self.ended = threading.Event()

    def check(self) -> float | None:
        if (n := prompt_tokens(self.base_url)) is not None and n > self.before:
            self.before, self.last = n, time.perf_counter()
            if self.at is None:
                self.at, self.first_count = self.last, n
        return self.at

    def tokens_per_s(self) -> float | None:
        """The server's prefill rate between the first and the last move seen (0.25 s apart at the finest)."""
        if self.at is None or self.last is None or self.last <= self.at:
            return None
        return (self.before - self.first_count) / (self.last - self.at)

    def run(self) -> None:
        while not self.ended.wait(0.25):
            self.check()

    def stop(self) -> None:
        self.ended.set()
        self.join(timeout=5)
