"""The HTTP server of `miles serve`: SGLang's native endpoints and OpenAI-style completions.

Standard library only (``http.server``, one thread per connection); the engine runs on its own
thread (:class:`ThreadedEngine`). Request bodies are JSON, at most ``max_request_bytes``; a body
that is too large gets 413, malformed JSON or fields 400 with the reason, an unknown path 404.
Streaming answers are server-sent events (``data: {...}`` lines, then ``data: [DONE]``), each
event carrying the text and output ids so far, as SGLang's do; the text is decoded incrementally
(:mod:`miles_core.serve.detokenize`), a bounded window of recent tokens per event.
"""

from __future__ import annotations

import base64
import json
import queue
import select
import socket
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from miles_core.errors import ConfigError, MilesUserError
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import trim_stop
from miles_core.rollout.engine_core.request import Request
from miles_core.rollout.engine_core.threaded import ThreadedEngine
from miles_core.serve import openai
from miles_core.serve.detokenize import StreamText
from miles_core.serve.protocol import BadRequest, GenerateItem, flag, memory_tags, parse_generate, response
from miles_core.serve.weight_sync import DistributedReceiver


class Abandoned(Exception):
    """:meth:`MilesServer.wait` gave up on its requests (the client left, a deadline passed) and aborted them."""


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # connections waiting to be accepted: socketserver's default of 5 reset most connections of a client that opens
    # many at once (the sglang backend sends up to 64 /generate requests together); uvicorn, SGLang's server, uses 2048
    request_queue_size = 2048


class MilesServer:
    health_timeout_s = 20.0  # /health_generate answers 503 when its one-token request has not ended by then (SGLang's 20 s)

    def __init__(self, engine: ThreadedEngine, tokenizer, model_path: str, host: str = "127.0.0.1", port: int = 30000,
                 max_request_bytes: int = 64 << 20) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.max_request_bytes = max_request_bytes
        self.receiver = DistributedReceiver()  # /init_weights_update_group, /update_weights_from_distributed
        if max_request_bytes < 1:
            engine.shutdown()
            raise ConfigError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
        try:
            self.httpd = _HTTPServer((host, port), _make_handler(self))
        except (OSError, OverflowError) as exc:  # in use, not this machine's address, out of range
            engine.shutdown()
            raise ConfigError(f"cannot listen on {host}:{port}: {exc}") from None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="miles-http", daemon=True)
        self._thread.start()

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.shutdown()

    # ------------------------------------------------------------------ generation
    def text_of(self, req: Request, upto: int | None = None, trim: bool = True) -> str:
        """The text of ``req``'s output (its first ``upto`` tokens); ``trim``: without the matched stop
        string or stop token (SGLang's default; ``no_stop_trim`` keeps them)."""
        ids = req.output_ids if upto is None else req.output_ids[:upto]
        if not trim:  # up to the end of the first stop string, as SGLang (a token may run past it)
            text = self.tokenizer.decode(ids)
            ends = [i + len(s) for s in req.params.stop if (i := text.find(s)) >= 0]
            return text[: min(ends)] if ends else text
        text = self.tokenizer.decode([t for t in ids if t not in req.stop_ids])
        return trim_stop(text, req.params.stop) if req.params.stop else text

    def stream_text(self, req: Request, trim: bool = True) -> StreamText:
        """What :meth:`text_of` gives for the tokens streamed so far, kept as they arrive: each event then decodes a
        bounded window of recent tokens, where a whole decode per event made a stream quadratic in its length."""
        return StreamText(self.tokenizer.decode, req.params.stop, req.stop_ids if trim else (), keep_stop=not trim)

    def submit(self, items: list[GenerateItem]) -> list[tuple[GenerateItem, list[Request], queue.Queue]]:
        handles = []
        try:
            for it in items:
                reqs, sink = self.engine.submit(it.prompt_ids, it.params, it.rid, it.n)
                handles.append((it, reqs, sink))
        except Exception:  # a later prompt refused: so is the whole request, and none of it runs on unseen
            self.abort(handles)
            raise
        return handles

    def abort(self, handles) -> None:
        for _it, reqs, _sink in handles:
            for r in reqs:
                self.engine.abort(r.request_id)

    def wait(self, handles, give_up=None) -> list[tuple[GenerateItem, Request]]:
        """Block until every request is finished; (item, request) prompt by prompt, sample by sample.
        ``give_up()``, asked every ``_POLL_S`` seconds meanwhile: True once the client has closed its connection
        (SGLang then aborts its requests too) or a deadline has passed; every request is then aborted and
        :class:`Abandoned` raised."""
        for _it, reqs, sink in handles:
            left = len(reqs)
            while left:
                try:
                    left -= sink.get(timeout=_POLL_S if give_up else None).finished
                except queue.Empty:
                    if give_up():
                        self.abort(handles)
                        raise Abandoned from None
        return [(it, r) for it, reqs, _ in handles for r in reqs]


def _stream_event_text(text: StreamText, new_ids: list[int]) -> str:
    """The cumulative text of an intermediate /generate event (SGLang streams the text so far, not a delta): ``text``
    given the event's new tokens. A finished request's event decodes its whole output instead, once, so its text is
    exactly the non-streamed answer's whatever the tokenizer (see :mod:`miles_core.serve.detokenize`)."""
    text.push(new_ids)
    return text.text()


def _make_handler(server: MilesServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet by default
            pass

        # ---------------------------------------------------------- plumbing
        def _send(self, status: int, payload: Any) -> None:
            data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
            self.headers_sent = True
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if not isinstance(payload, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "code": status}})

        def _body(self) -> Any:
            length = self.headers.get("Content-Length")
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raise _HTTPError(HTTPStatus.LENGTH_REQUIRED, "chunked request bodies are not accepted; send Content-Length")
            if length is None:
                return {}
            try:
                n = int(length)
            except ValueError:
                raise _HTTPError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}") from None
            if n < 0:  # rfile.read(-1) would read until the client closes, past the size bound
                raise _HTTPError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {length!r}")
            if n > server.max_request_bytes:
                raise _HTTPError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"request body of {n} bytes exceeds the limit of {server.max_request_bytes}")
            raw = self.rfile.read(n)
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _HTTPError(HTTPStatus.BAD_REQUEST, f"malformed JSON: {exc}") from None
            except RecursionError:  # nesting deeper than the parser's recursion limit, within the size bound
                raise _HTTPError(HTTPStatus.BAD_REQUEST, "malformed JSON: nested too deeply") from None
            if not isinstance(body, dict):  # every endpoint reads named fields from it
                raise _HTTPError(HTTPStatus.BAD_REQUEST, "the request body must be a JSON object")
            return body

        def _gone(self) -> bool:
            """True once the client has closed its end (readable with nothing to read); a pipelined next
            request is not that."""
            try:
                return bool(select.select([self.connection], [], [], 0)[0]) and not self.connection.recv(1, socket.MSG_PEEK)
            except OSError:
                return True

        def _start_stream(self) -> None:
            self.headers_sent = True
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

        def _event(self, payload: Any) -> None:
            self.wfile.write(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n")
            self.wfile.flush()

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def _route(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            self.headers_sent = False  # set by _send / _start_stream
            fn = ROUTES.get(path)
            if fn is None:
                self._error(404, f"no endpoint {path}")
                return
            try:
                body = self._body() if method == "POST" else {}
                fn(self, body)
            except _HTTPError as exc:
                self.close_connection = True
                self._error(exc.status, exc.message)
            except (BadRequest, MilesUserError, ValueError, TypeError, KeyError) as exc:
                self._error(400, str(exc) or type(exc).__name__)
            except (BrokenPipeError, ConnectionResetError, Abandoned):
                self.close_connection = True
            except Exception as exc:  # a fault of the server's own: the client is told (500), the server serves on
                self.close_connection = True
                if self.headers_sent:  # mid-stream: the status is gone; ending the stream is all that is left
                    return
                self._error(500, f"internal error: {type(exc).__name__}: {exc}")
                traceback.print_exc()

        # ---------------------------------------------------------- SGLang endpoints
        def health(self, body):
            self._send(200, "")

        def health_generate(self, body):
            ids = server.tokenizer.encode("hi") or [0]
            items = [GenerateItem(ids, SamplingParams(max_new_tokens=1, temperature=0), 1, None, False, 0)]
            deadline = time.monotonic() + server.health_timeout_s
            try:  # bounded: a paused or overloaded engine answers 503 instead of holding the probe (and a request) forever
                server.wait(server.submit(items), lambda: self._gone() or time.monotonic() > deadline)
            except Abandoned:
                self._send(503, "")
                return
            self._send(200, "")

        def model_info(self, body):
            core = server.engine.core
            self._send(200, {
                "model_path": server.model_path, "tokenizer_path": server.model_path, "is_generation": True,
                "weight_version": str(core.weight_version), "max_model_len": core.max_model_len,
                "paused": server.engine.paused,
            })

        def generate(self, body):
            items, batch, stream = parse_generate(body, server.tokenizer.encode)
            t0 = time.perf_counter()
            version = lambda: server.engine.core.weight_version  # noqa: E731  (a partial event; a finished request: the one it ended under)
            handles = server.submit(items)
            if stream:
                _it, reqs, sink = handles[0]
                self._start_stream()
                try:
                    left = len(reqs)
                    index = {r.request_id: i for i, r in enumerate(reqs)} if len(reqs) > 1 else {}  # SGLang's "index" of n samples
                    texts = {r.request_id: server.stream_text(r, not _it.no_stop_trim) for r in reqs}  # their text, decoded as it comes
                    emitted: dict[str, int] = {}  # output tokens per request so far, from the outputs themselves:
                    while left:  # the engine thread may be steps ahead of this one (and done) by the time an event is written
                        out = sink.get()
                        left -= out.finished
                        req, n = out.request, emitted.get(out.request_id, 0) + len(out.new_ids)
                        emitted[out.request_id] = n
                        part = None if out.finished else n
                        v = version() if part is not None else req.weight_version
                        text = server.text_of(req, None, not _it.no_stop_trim) if out.finished else _stream_event_text(texts[out.request_id], out.new_ids)
                        event = response(req, text, _it.return_logprob, v, time.perf_counter() - t0, part)
                        if index:
                            event["index"] = index[out.request_id]
                        self._event(event)
                    self._event(b"[DONE]")
                except (BrokenPipeError, ConnectionResetError):  # the client went away: stop its requests
                    for r in reqs:
                        server.engine.abort(r.request_id)
                return
            outs = [response(req, server.text_of(req, None, not it.no_stop_trim), it.return_logprob, req.weight_version, time.perf_counter() - t0)
                    for it, req in server.wait(handles, self._gone)]
            self._send(200, outs if batch else outs[0])

        def abort_request(self, body):
            if flag(body.get("abort_all"), "'abort_all'"):  # not truthiness: "false" would abort every request
                n = server.engine.call(lambda core: sum(core.abort(r) for r in list(core.requests)))
                self._send(200, {"success": True, "aborted": n})
                return
            rid = body.get("rid")
            if not isinstance(rid, str):
                raise BadRequest("give 'rid' (a string) or 'abort_all': true")
            # the request itself, or every sample of the n > 1 group it named (not another request whose id merely starts so)
            ok = server.engine.call(lambda core: sum(core.abort(r) for r, req in list(core.requests.items()) if rid in (r, req.group_id)))
            self._send(200, {"success": bool(ok)})

        def flush_cache(self, body):
            ok = server.engine.call(lambda core: core.flush_cache())
            self._send(200 if ok else 400, "Cache flushed." if ok else "Cache not flushed: requests are running.")

        def pause(self, body):
            mode = body.get("mode", "abort")
            if mode not in ("abort", "in_place", "retract"):
                raise BadRequest("pause_generation: mode must be abort, in_place or retract")
            server.engine.pause()
            if mode == "abort":
                server.engine.call(lambda core: [core.abort(r) for r in list(core.requests)])
            self._send(200, {"success": True, "message": f"paused ({mode})"})

        def resume(self, body):
            server.engine.resume()
            self._send(200, {"success": True, "message": "resumed"})

        def update_from_disk(self, body):
            path = body.get("model_path")
            if not isinstance(path, str):
                raise BadRequest("update_weights_from_disk needs 'model_path'")
            version = _version(body)
            server.engine.call(lambda core: core.update_weights_from_disk(path, version))
            self._send(200, {"success": True, "message": f"loaded {path}", "weight_version": str(server.engine.core.weight_version)})

        def update_from_tensor(self, body):
            tensors = body.get("named_tensors")
            if not isinstance(tensors, list) or not tensors:
                raise BadRequest("update_weights_from_tensor needs 'named_tensors': [{name, dtype, shape, data (base64)}]")
            state = {}
            for t in tensors:
                try:
                    dtype = getattr(torch, t["dtype"])
                    raw = bytearray(base64.b64decode(t["data"], validate=True))
                    state[t["name"]] = torch.frombuffer(raw, dtype=dtype).reshape(t["shape"]).clone()
                except (KeyError, TypeError, AttributeError, ValueError, RuntimeError) as exc:
                    raise BadRequest(f"bad entry in named_tensors: {exc}") from None
            version = _version(body)
            server.engine.call(lambda core: core.update_weights(state, version))
            self._send(200, {"success": True, "message": f"updated {len(state)} tensors", "weight_version": str(server.engine.core.weight_version)})

        def init_group(self, body):
            server.receiver.init_group(body)
            self._send(200, {"success": True, "message": f"joined {body.get('group_name')}"})

        def update_from_distributed(self, body):
            device = next(server.engine.core.model.parameters()).device
            state = server.receiver.receive(body, device)
            version = _version(body)
            server.engine.call(lambda core: core.update_weights(state, version))
            self._send(200, {"success": True, "message": f"updated {len(state)} tensors", "weight_version": str(server.engine.core.weight_version)})

        def weight_version(self, body):
            self._send(200, {"weight_version": str(server.engine.core.weight_version)})

        def release(self, body):
            tags = memory_tags(body.get("tags"))
            server.engine.call(lambda core: core.release_memory(tags))
            self._send(200, {"success": True})

        def resume_memory(self, body):
            tags = memory_tags(body.get("tags"))
            server.engine.call(lambda core: core.resume_memory(tags))
            self._send(200, {"success": True})

        # ---------------------------------------------------------- OpenAI endpoints
        def completions(self, body):
            openai.completions(self, server, body, chat=False)

        def chat(self, body):
            openai.completions(self, server, body, chat=True)

        def models(self, body):
            self._send(200, {"object": "list", "data": [{"id": server.model_path, "object": "model", "owned_by": "miles"}]})

    ROUTES = {
        "/health": Handler.health,
        "/health_generate": Handler.health_generate,
        "/get_model_info": Handler.model_info,
        "/model_info": Handler.model_info,  # SGLang 0.5.23's name; /get_model_info is deprecated there
        "/generate": Handler.generate,
        "/abort_request": Handler.abort_request,
        "/flush_cache": Handler.flush_cache,
        "/pause_generation": Handler.pause,
        "/continue_generation": Handler.resume,
        "/update_weights_from_disk": Handler.update_from_disk,
        "/update_weights_from_tensor": Handler.update_from_tensor,
        "/init_weights_update_group": Handler.init_group,
        "/update_weights_from_distributed": Handler.update_from_distributed,
        "/get_weight_version": Handler.weight_version,
        "/release_memory_occupation": Handler.release,
        "/resume_memory_occupation": Handler.resume_memory,
        "/v1/completions": Handler.completions,
        "/v1/chat/completions": Handler.chat,
        "/v1/models": Handler.models,
    }
    return Handler


_POLL_S = 0.5  # how often a non-streaming request checks that its client is still connected (and its deadline)


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = int(status), message


def _version(body: dict) -> int | None:
    """The body's ``weight_version``: a whole number (SGLang sends it as text: "3"), or None. int() alone took 2.7 for 2
    and true for 1."""
    v = body.get("weight_version")
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            pass
    elif isinstance(v, int) and not isinstance(v, bool):
        return v
    raise BadRequest(f"weight_version must be a whole number, got {v!r}")
