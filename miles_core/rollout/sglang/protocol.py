"""SGLang's /generate protocol on the client side: the ``sampling_params`` we send and the
``meta_info`` we read (field names as in SGLang 0.5.23's ``SamplingParams`` and
``TokenizerManager`` outputs; `miles serve` answers with the same)."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles_core.errors import MilesUserError
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.sglang.http import field


def sampling_params(p: SamplingParams, n: int) -> dict[str, Any]:
    """SGLang's ``sampling_params`` for ``p`` (top_k -1 = off)."""
    sp: dict[str, Any] = {
        "max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1, "min_p": p.min_p, "ignore_eos": p.ignore_eos, "n": n,
    }
    if p.stop:
        sp["stop"] = list(p.stop)
    if p.stop_token_ids:
        sp["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        sp["sampling_seed"] = p.seed
    return sp


def generate_body(prompt_ids: list[int], params: SamplingParams, n: int) -> dict[str, Any]:
    """The ``/generate`` body of one prompt group. With a sampling seed, sample ``i`` samples with ``seed + i``, as
    the built-in engine gives it (deterministic mode): the group goes as a batch of ``n`` prompts with a seed each,
    since one request with ``n`` has one seed (SGLang then samples the same tokens ``n`` times)."""
    if params.seed is None:
        body: dict[str, Any] = {"input_ids": list(prompt_ids), "sampling_params": sampling_params(params, n)}
    else:
        body = {"input_ids": [list(prompt_ids)] * n,
                "sampling_params": [sampling_params(dataclasses.replace(params, seed=params.seed + i), 1) for i in range(n)]}
    body["return_logprob"] = True
    if params.top_logprobs:
        body["top_logprobs_num"] = params.top_logprobs
    return body


def parse_output(out: Any, url: str) -> tuple[list[int], list[float], str, int | None]:
    """One answer of /generate -> (output ids, their logprobs, finish reason, weight version)."""
    meta = field(out, "meta_info", url, dict)
    fr = meta.get("finish_reason")
    reason = fr.get("type") if isinstance(fr, dict) else fr
    if reason == "abort" and "output_token_logprobs" not in meta:
        # SGLang's answer to a request aborted while still queued ("Abort before prefill"): no tokens, no logprobs
        triples = []
    else:
        triples = field(meta, "output_token_logprobs", url, list)
    ids = out.get("output_ids")
    try:
        lps = [float(t[0]) for t in triples]
        lp_ids = [int(t[1]) for t in triples]
    except (TypeError, ValueError, IndexError):
        raise MilesUserError(f"{url}: malformed response, field 'meta_info.output_token_logprobs' must be [logprob, token_id, text] triples") from None
    if ids is None:
        ids = lp_ids
    if not isinstance(ids, list) or list(ids) != lp_ids:
        raise MilesUserError(f"{url}: malformed response, field 'output_ids' does not match 'meta_info.output_token_logprobs'")
    if reason not in ("stop", "length", "abort"):
        raise MilesUserError(f"{url}: malformed response, field 'meta_info.finish_reason' is {fr!r}")
    version = meta.get("weight_version")
    if version == "default":  # SGLang's name for the weights it started with
        version = 0
    if version is not None:
        try:
            version = int(version)
        except (TypeError, ValueError):
            raise MilesUserError(f"{url}: malformed response, field 'meta_info.weight_version' is {version!r}, not an integer") from None
    return list(ids), lps, reason, version
