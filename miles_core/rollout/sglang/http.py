"""A small JSON-over-HTTP client (standard library) with errors that name the URL and the field.

``EngineDown``: the server did not answer (refused, reset, timed out) -- the caller may recover.
Every other failure (an HTTP error status, a body that is not JSON, a missing field) is a
:class:`MilesUserError` with one line naming the url and what was wrong.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any

from miles_core.errors import MilesUserError


class EngineDown(ConnectionError):
    """The server at ``url`` did not answer."""

    def __init__(self, url: str, reason: str, timed_out: bool = False) -> None:
        super().__init__(f"{url}: no answer ({reason})")
        self.url = url
        self.timed_out = timed_out  # the server took longer than the timeout (it may still be up and working)


def request(url: str, payload: Any = None, timeout: float = 60.0, method: str | None = None) -> Any:
    """POST ``payload`` as JSON (GET when it is None) and return the decoded JSON (or text) answer."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        raise MilesUserError(f"{url}: the server answered HTTP {exc.code}: {body}") from None
    except urllib.error.URLError as exc:
        raise EngineDown(url, str(exc.reason), isinstance(exc.reason, TimeoutError)) from None
    except (ConnectionError, http.client.HTTPException, socket.timeout, TimeoutError, OSError) as exc:
        raise EngineDown(url, f"{type(exc).__name__}: {exc}", isinstance(exc, TimeoutError)) from None
    text = raw.decode(errors="replace")
    if not text:
        return ""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def field(obj: Any, name: str, url: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``obj[name]``, or a MilesUserError naming the url and the field."""
    if not isinstance(obj, dict) or name not in obj:
        raise MilesUserError(f"{url}: malformed response, field '{name}' is missing (got {str(obj)[:200]})")
    value = obj[name]
    if kind is not None and not isinstance(value, kind):
        raise MilesUserError(f"{url}: malformed response, field '{name}' has type {type(value).__name__}")
    return value


# SGLang's /health sends a one-token request and answers once the scheduler has produced anything since: never in
# under a second (it polls every second), up to its 20 s HEALTH_CHECK_TIMEOUT on a busy server
HEALTH_TIMEOUT_S = 25.0


def healthy(url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    try:
        request(url.rstrip("/") + "/health", timeout=timeout)
        return True
    except (EngineDown, MilesUserError):
        return False
