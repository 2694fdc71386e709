"""Request parsing and response building for SGLang's native protocol.

Field names follow SGLang's ``GenerateReqInput`` and ``SamplingParams`` (``text`` / ``input_ids``,
``sampling_params``, ``rid``, ``return_logprob``, ``top_logprobs_num``, ``stream``; ``max_new_tokens``,
``temperature``, ``top_p``, ``top_k`` (-1 = off), ``min_p``, ``stop``, ``stop_token_ids``,
``ignore_eos``, ``n``, ``sampling_seed``, ``no_stop_trim``), and of its ``meta_info`` (``id``, ``finish_reason``
as ``{"type": "stop"|"length"|"abort", ...}``, ``prompt_tokens``, ``completion_tokens``,
``cached_tokens``, ``output_token_logprobs`` as ``[logprob, token_id, None]`` triples,
``output_top_logprobs``, ``weight_version``). Unknown sampling fields are rejected, so a typo is a 400
rather than a silently ignored knob; so is ``logprob_start_len`` >= 0 (the prompt's own token logprobs, not
computed here). Other top-level fields of SGLang's (``image_data``, ``lora_path``, ...) are ignored.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core.request import Request


class BadRequest(ValueError):
    """A malformed request: the server answers 400 with this message."""


_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "n",
    "sampling_seed", "seed", "skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
}
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


@dataclass
class GenerateItem:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    no_stop_trim: bool = False  # the text keeps the matched stop string or stop token's text


def flag(value: Any, name: str) -> bool:
    """A boolean field: true, false, or null (false). Anything else is refused, not read by truthiness
    (``bool("false")`` is True)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {value!r}")
    return value


_MEMORY_TAGS = ("weights", "kv_cache")


def memory_tags(value: Any) -> list[str]:
    """``tags`` of /release_memory_occupation and /resume_memory_occupation: null (all) or a list of tag names.
    A bare string is refused, not iterated as characters."""
    if value is None or value == []:
        return list(_MEMORY_TAGS)
    if not isinstance(value, list) or not all(isinstance(t, str) and t in _MEMORY_TAGS for t in value):
        raise BadRequest(f"tags must be a list of {', '.join(_MEMORY_TAGS)}, got {value!r}")
    return value


def _num(d: dict, key: str, kind, default, lo=None, hi=None, lo_open=False):
    v = d.get(key, default)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"sampling_params.{key} must be an integer, got {v!r}")
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise BadRequest(f"sampling_params.{key} must be a number, got {v!r}")
    if kind is float and not -sys.float_info.max <= v <= sys.float_info.max:  # NaN, Infinity (Python's JSON reads them), 1e400
        raise BadRequest(f"sampling_params.{key} must be a finite number, got {v!r}")
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise BadRequest(f"sampling_params.{key}={v} is out of range")
    return kind(v)


def parse_sampling(sp: Any, default_max_new: int = 128) -> tuple[SamplingParams, int]:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = set(sp) - _SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unsupported sampling_params: {', '.join(sorted(unknown))}")
    for key, neutral in _NEUTRAL.items():
        if sp.get(key, neutral) not in (neutral, None):
            raise BadRequest(f"sampling_params.{key} is not supported by the built-in engine (leave it at {neutral})")
    stop = sp.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("sampling_params.stop must be a string or a list of non-empty strings")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("sampling_params.stop_token_ids must be a list of integers")
    top_k = _num(sp, "top_k", int, -1)
    seed = sp.get("sampling_seed", sp.get("seed"))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("sampling_params.sampling_seed must be an integer")
    params = SamplingParams(
        max_new_tokens=_num(sp, "max_new_tokens", int, default_max_new, lo=1),
        temperature=_num(sp, "temperature", float, 1.0, lo=0.0),
        top_p=_num(sp, "top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=0 if top_k in (-1, 0) else _num(sp, "top_k", int, -1, lo=1),
        min_p=_num(sp, "min_p", float, 0.0, lo=0.0, hi=1.0),
        stop=stop,
        stop_token_ids=list(stop_ids),
        ignore_eos=flag(sp.get("ignore_eos"), "sampling_params.ignore_eos"),
        seed=seed,
    )
    return params, _num(sp, "n", int, 1, lo=1, hi=1024)


def _listify(value, count: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"{name} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def parse_generate(body: Any, encode) -> tuple[list[GenerateItem], bool, bool]:
    """-> (items, is_batch, stream). ``encode(text) -> ids``."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if text is not None:
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("'text' must be a string or a non-empty list of strings")
        prompts = [encode(t) for t in texts]
    else:
        batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        ok = isinstance(ids, list) and all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts)
        if not ok:
            raise BadRequest("'input_ids' must be a non-empty list of integers (or a list of such lists)")
    k = len(prompts)
    sps = _listify(body.get("sampling_params"), k, "sampling_params")
    rids = _listify(body.get("rid"), k, "rid")
    lps = [flag(v, "'return_logprob'") for v in _listify(body.get("return_logprob"), k, "return_logprob")]
    tops = _listify(body.get("top_logprobs_num", 0) or 0, k, "top_logprobs_num")
    starts = _listify(body.get("logprob_start_len"), k, "logprob_start_len")
    if any(s is not None and s != -1 for s in starts):  # -1 / absent: SGLang's "no input token logprobs"
        raise BadRequest("logprob_start_len: the prompt's token logprobs (input_token_logprobs) are not served here; "
                         "give -1 or leave it out (output token logprobs come with return_logprob)")
    stream = flag(body.get("stream"), "'stream'")
    if stream and k > 1:
        raise BadRequest("streaming is supported for a single prompt")
    items = []
    for i in range(k):
        params, n = parse_sampling(sps[i])
        if rids[i] is not None and not isinstance(rids[i], str):
            raise BadRequest("'rid' must be a string")
        if not isinstance(tops[i], int) or isinstance(tops[i], bool) or not 0 <= tops[i] <= 100:
            raise BadRequest("'top_logprobs_num' must be an integer in [0, 100]")
        params.top_logprobs = tops[i] if lps[i] else 0
        keep = flag((sps[i] or {}).get("no_stop_trim"), "sampling_params.no_stop_trim")
        items.append(GenerateItem(list(prompts[i]), params, n, rids[i], lps[i], tops[i], keep))
    return items, batch or any(it.n > 1 for it in items), stream


def finish_reason(req: Request) -> dict | None:
    r = req.finish_reason
    if r is None:
        return None
    if r == "length":
        return {"type": "length", "length": len(req.output_ids)}
    if r == "stop":
        return {"type": "stop", "matched": req.matched_stop}
    return {"type": "abort", "message": req.matched_stop or "aborted"}


def response(req: Request, text: str, return_logprob: bool, weight_version: int, latency: float, partial: int | None = None) -> dict:
    """``req``'s answer; ``partial``: an intermediate stream event covering its first ``partial`` output
    tokens, unfinished, whatever the engine thread has appended to ``req`` since (it runs on)."""
    n = len(req.output_ids) if partial is None else partial
    ids = req.output_ids[:n]
    meta: dict[str, Any] = {
        "id": req.request_id,
        "finish_reason": finish_reason(req) if partial is None else None,
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(ids),
        "cached_tokens": req.num_cached,
        "weight_version": str(weight_version),
        "e2e_latency": latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(req.logprobs[:n], ids)]
        if req.params.top_logprobs:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row] for row in req.top_logprobs[:n]]
    if req.routed_experts and partial is None:
        import torch

        meta["routed_experts"] = torch.cat(req.routed_experts).tolist()
    return {"text": text, "output_ids": list(ids), "meta_info": meta}
