"""Supervised (prompt, response) examples from JSONL, with loss masks.

One JSON object per line. ``data.prompt_key`` holds the prompt text; ``data.response_key`` holds
either a string (every response token is trained on) or a list of segments
``{"text": "...", "train": true|false}``: the tokens of a segment with ``train: false`` (a tool
output, a quoted document) are in the sequence but masked out of the loss. The prompt is never
trained on. An end-of-sequence token closes the response and is trained on.

Every line is checked when the file is read, so a bad file fails at start-up with its line.
"""

from __future__ import annotations


from miles_core.data.jsonl import read_rows
from miles_core.errors import DataError
from miles_core.types import Sample


def _segments(value: object, where: str, key: str) -> list[tuple[str, bool]]:
    if isinstance(value, str):
        return [(value, True)]
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: '{key}' must be a string or a non-empty list of {{'text', 'train'}} segments")
    out = []
    for i, seg in enumerate(value):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str):
            raise DataError(f"{where}: '{key}'[{i}] must be an object with a string 'text'")
        train = seg.get("train", True)
        if not isinstance(train, bool):
            raise DataError(f"{where}: '{key}'[{i}].train must be true or false")
        out.append((seg["text"], train))
    return out


def sft_sample(prompt: str, segments: list[tuple[str, bool]], tokenizer, index: int) -> Sample:
    response_ids: list[int] = []
    mask: list[int] = []
    for text, train in segments:
        ids = tokenizer.encode(text)
        response_ids += ids
        mask += [int(train)] * len(ids)
    response_ids.append(tokenizer.eos_token_id)
    mask.append(1)
    text = "".join(t for t, _ in segments)
    return Sample(prompt, tokenizer.encode(prompt), response_ids, text, [], label=text, group_id=index, index=index, loss_mask=mask)


def read_sft_examples(path: str, prompt_key: str, response_key: str, tokenizer) -> list[Sample]:
    samples: list[Sample] = []
    for where, row in read_rows(path):
        if not isinstance(row, dict) or not isinstance(row.get(prompt_key), str):
            raise DataError(f"{where}: expected an object with a string '{prompt_key}' (set data.prompt_key)")
        if response_key not in row:
            raise DataError(f"{where}: missing key '{response_key}' (set data.response_key)")
        sample = sft_sample(row[prompt_key], _segments(row[response_key], where, response_key), tokenizer, len(samples))
        if not sample.prompt_ids:  # the first response token is predicted from the position before it: there is none
            raise DataError(f"{where}: '{prompt_key}' is empty (the response needs at least one prompt token before it)")
        sample.metadata["source"] = where  # for start-up checks that name the line (the character alphabet)
        samples.append(sample)
    if not samples:
        raise DataError(f"data file '{path}' has no examples")
    return samples
