"""HTTP for the tool's own clients — a vLLM server's API and /metrics, an exporter's page — in one place, on
the standard library's urllib (the clients are few and loopback; no session, retry or pool is wanted):
a GET that says what came back, a JSON POST, and a POST whose answer is a stream of server-sent events."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator


def get(url: str, timeout: float = 2.0, headers: dict | None = None) -> tuple[int, str]:
    """(status, body); (0, "") where nothing answered (refused, unreachable, timed out)."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback/operator URL
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, ""


def read(url: str, timeout: float) -> str:
    """The body at `url`; OSError (urllib's URLError is one) or http.client.HTTPException where none came."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - an operator's URL
        return resp.read().decode(errors="replace")


def _post(url: str, body: dict, headers: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json", **headers}, method="POST")


def post_json(url: str, body: dict, headers: dict, timeout: float) -> dict:
    """POST `body` as JSON; the JSON answer (HTTPError for a status ≥ 400)."""
    with urllib.request.urlopen(_post(url, body, headers), timeout=timeout) as resp:  # noqa: S310 - our server
        return json.loads(resp.read())


def post_events(url: str, body: dict, headers: dict, timeout: float) -> Iterator[dict]:
    """POST `body` as JSON; the server-sent events of the answer, each `data:` line's JSON, until `[DONE]`."""
    with urllib.request.urlopen(_post(url, body, headers), timeout=timeout) as resp:  # noqa: S310 - our server
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            yield json.loads(payload)
