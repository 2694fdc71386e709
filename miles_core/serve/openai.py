"""OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` over the same engine.

Request fields: ``prompt`` (text or token ids) or ``messages`` (chat; rendered with the
tokenizer's chat template when it has one, else ``role: content`` lines), ``max_tokens`` or
``max_completion_tokens`` (absent: 16 for a completion, a chat to its end, as OpenAI's and SGLang's),
``temperature``, ``top_p``, ``n``, ``stop``, ``seed``, ``logprobs`` (completions: an int = top-k;
chat: a bool with ``top_logprobs``), ``stream``, and SGLang's ``top_k``, ``min_p``, ``stop_token_ids``, ``ignore_eos``;
penalties, ``min_tokens`` and ``logit_bias`` other than their neutral values are refused (400). Responses follow OpenAI's ``text_completion`` /
``chat.completion`` objects, with ``usage``.
"""

from __future__ import annotations

import time
import uuid

from miles_core.serve.detokenize import StreamText
from miles_core.serve.protocol import BadRequest, GenerateItem, flag, parse_sampling

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
# request field -> /generate's sampling_params key: OpenAI's, then SGLang's extras to them (its OpenAI server takes them too)
_SAMPLING = (("temperature", "temperature"), ("top_p", "top_p"), ("n", "n"), ("stop", "stop"), ("seed", "sampling_seed"),
             ("top_k", "top_k"), ("min_p", "min_p"), ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"))
# fields of OpenAI's (and SGLang's) the engine does not implement -> the value that means "off"
_UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_tokens": 0, "logit_bias": {}}


def _render_chat(tokenizer, messages) -> list[int]:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    hf = getattr(tokenizer, "tok", None)
    if hf is not None and getattr(hf, "chat_template", None):
        # rendered as text, then encoded as the RL loop encodes it (data.tokenizer.HFTokenizer.render_chat): with
        # tokenize=True, transformers 5 returns a BatchEncoding, which list() turns into its keys
        try:
            text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template that refuses the messages (Gemma's: "System role not supported")
            roles = ", ".join(str(m.get("role")) for m in messages)
            raise BadRequest(f"'messages': the model's chat template cannot render roles [{roles}]: "
                             f"{type(exc).__name__}: {' '.join(str(exc).split())}") from None
        return tokenizer.encode(text)
    text = "".join(f"{m.get('role', 'user')}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer.encode(text)


def _item(server, body: dict, chat: bool) -> GenerateItem:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if chat:
        ids = _render_chat(server.tokenizer, body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            ids = server.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids")
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise BadRequest(f"'{key}' must be a positive integer, got {v!r}")
    # absent: OpenAI's (and SGLang's) defaults, 16 tokens for a completion, a chat's to its end (the context's limit)
    default = server.engine.core.max_model_len if chat else 16
    sp = {"max_new_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or default}
    for key, neutral in _UNSUPPORTED.items():  # refused, not dropped: the request would run with other sampling than asked
        if body.get(key) not in (None, neutral):
            raise BadRequest(f"'{key}' is not supported by the built-in engine (leave it out or at {neutral!r})")
    for src, dst in _SAMPLING:
        if body.get(src) is not None:
            sp[dst] = body[src]
    params, n = parse_sampling(sp)
    top = 0
    want = flag(body.get("logprobs"), "'logprobs'") if chat else body.get("logprobs") is not None
    if chat and not want and body.get("top_logprobs") not in (None, 0):
        raise BadRequest("'top_logprobs' needs 'logprobs': true")
    if chat and want:
        top = body.get("top_logprobs") or 0
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise BadRequest("'top_logprobs' must be an integer in [0, 20]")
    elif not chat and body.get("logprobs") is not None:
        top = body["logprobs"]
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            raise BadRequest("'logprobs' must be an integer in [0, 20]")
    params.top_logprobs = top
    return GenerateItem(ids, params, n, None, want, top)


def _logprobs(server, req, chat: bool, start: int = 0, stop: int | None = None):
    """The logprobs of ``req``'s output tokens ``[start:stop]`` (a stream chunk's; the engine thread may have appended more)."""
    stop = len(req.output_ids) if stop is None else stop
    toks = [server.tokenizer.decode([t]) for t in req.output_ids[start:stop]]
    lps, rows = req.logprobs[start:stop], req.top_logprobs[start:stop] if req.top_logprobs else None
    if chat:
        content = []
        for i, (t, lp) in enumerate(zip(toks, lps)):
            tops = rows[i] if rows else []
            content.append({"token": t, "logprob": lp, "top_logprobs": [{"token": server.tokenizer.decode([j]), "logprob": v} for j, v in tops]})
        return {"content": content}
    return {
        "tokens": toks,
        "token_logprobs": list(lps),
        "top_logprobs": [{server.tokenizer.decode([j]): v for j, v in row} for row in rows] if rows else None,
    }


def settled_end(text: StreamText, stop: list[str]) -> int:
    """Where the part of ``text`` (a request's text so far) that later tokens cannot change ends: a trailing
    incomplete character, or a tail that may be the start of a stop string, is held back until the next token
    settles it. Stream deltas are cut up to it, so joined they equal the final text. Reads only the text's tail."""
    end = text.before_replacements(text.end())
    tail = text.slice(max(0, end - max(map(len, stop), default=1) + 1), end)
    return end - max((k for s in stop for k in range(1, len(s)) if tail.endswith(s[:k])), default=0)


def stream_delta(server, req, text: StreamText, new_ids: list[int], finished: bool, sent: int) -> tuple[str, int] | None:
    """The next delta of a streamed completion and the characters sent after it, or None while nothing new is settled.
    ``text``: the request's :meth:`MilesServer.stream_text`, given ``new_ids``; ``sent``: characters sent so far. The last
    delta is cut from the whole output decoded once, so the stream ends on exactly the non-streamed answer's text."""
    if finished:
        full = server.text_of(req)
        return full[sent:], max(sent, len(full))
    text.push(new_ids)
    end = settled_end(text, req.params.stop)
    if end <= sent:
        return None
    return text.slice(sent, end), end


def completions(handler, server, body, chat: bool) -> None:
    item = _item(server, body, chat)
    stream = flag(body.get("stream"), "'stream'")
    oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    model = body.get("model") or server.model_path
    handles = server.submit([item])
    _it, reqs, sink = handles[0]
    if stream:
        handler._start_stream()
        sent = {r.request_id: 0 for r in reqs}  # characters streamed so far
        texts = {r.request_id: server.stream_text(r) for r in reqs}  # the text of the tokens this thread has seen (the engine may be ahead)
        index = {r.request_id: i for i, r in enumerate(reqs)}
        tokens = {r.request_id: [0, 0] for r in reqs}  # output tokens seen so far, and those whose logprobs were sent
        left = len(reqs)
        try:
            while left:
                out = sink.get()
                left -= out.finished
                rid, req = out.request_id, out.request
                tokens[rid][0] += len(out.new_ids)
                step = stream_delta(server, req, texts[rid], out.new_ids, out.finished, sent[rid])
                if step is None:
                    continue  # nothing settled yet
                (delta, sent_now), first = step, sent[rid] == 0
                sent[rid] = sent_now
                choice = {"index": index[rid], "finish_reason": _FINISH.get(req.finish_reason) if out.finished else None}
                if chat:
                    choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta}
                else:
                    choice["text"] = delta
                if item.return_logprob:  # the tokens since the last chunk: joined, the non-streamed answer's logprobs
                    choice["logprobs"] = _logprobs(server, req, chat, tokens[rid][1], tokens[rid][0])
                    tokens[rid][1] = tokens[rid][0]
                handler._event({"id": oid, "object": kind + ".chunk" if chat else kind, "created": created, "model": model, "choices": [choice]})
            handler._event(b"[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            for r in reqs:
                server.engine.abort(r.request_id)
        return
    done = [r for _i, r in server.wait(handles, handler._gone)]
    choices = []
    for i, req in enumerate(done):
        text = server.text_of(req)
        c = {"index": i, "finish_reason": _FINISH.get(req.finish_reason, req.finish_reason)}
        if chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = _logprobs(server, req, chat) if item.return_logprob else None
        choices.append(c)
    completion = sum(len(r.output_ids) for r in done)
    handler._send(200, {
        "id": oid, "object": kind, "created": created, "model": model, "choices": choices,
        "usage": {"prompt_tokens": len(item.prompt_ids), "completion_tokens": completion, "total_tokens": len(item.prompt_ids) + completion},
    })
