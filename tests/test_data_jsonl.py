"""JSONL prompts: what a line may hold, what is refused with its line number, the exact-match verifier."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from miles_core.data.jsonl import JsonlTask, read_prompts
from miles_core.data.sft import read_sft_examples
from miles_core.data.tokenizer import CharTokenizer
from miles_core.errors import DataError


def _write(tmp_path, lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_prompts_labels_and_metadata(tmp_path):
    path = _write(tmp_path, [json.dumps({"q": "1+1?", "a": 2, "src": "x"}), "", "   ", json.dumps({"q": "hi"})])
    prompts = read_prompts(path, "q", "a")
    assert [(p.text, p.label, p.metadata) for p in prompts] == [("1+1?", 2, {"src": "x"}), ("hi", None, {})]


@pytest.mark.parametrize("line, message", [
    ('{"q": 3}', "d.jsonl:2: 'q' must be a string"),
    ("[1, 2]", "d.jsonl:2: expected a JSON object, got list"),
    ('{"x": "y"}', "d.jsonl:2: missing key 'q'"),
    ("{not json", "d.jsonl:2: not valid JSON"),
    # every response contains '' (contains_answer gave each 1.0) and an empty response matched it exactly
    ('{"q": "x", "a": ""}', r"d.jsonl:2: 'a' is empty \(no answer to check a response against\)"),
    ('{"q": "x", "a": " \\n"}', r"d.jsonl:2: 'a' is empty"),
])
def test_a_bad_line_is_named(tmp_path, line, message):
    path = _write(tmp_path, [json.dumps({"q": "ok"}), line])
    with pytest.raises(DataError, match=message):
        read_prompts(path, "q", "a")


def test_an_empty_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="has no prompts"):
        read_prompts(_write(tmp_path, ["", "  "]), "q", "a")


def test_score_is_an_exact_match_up_to_surrounding_whitespace(tmp_path):
    task = JsonlTask(_write(tmp_path, [json.dumps({"q": "x", "a": 42})]), None, "q", "a")
    assert task.score(" 42\n", 42) == 1.0
    assert task.score("42", " 42 ") == 1.0
    assert task.score("4 2", 42) == 0.0
    assert task.score("None", None) == 0.0  # no label: nothing matches
    assert task.eval_prompts() == []
    assert next(task.train_prompts(random.Random(0))).text == "x"


def test_a_list_label_is_a_list_of_accepted_answers(tmp_path):
    """A label ["4", "four"] was compared as its Python text "['4', 'four']": no response ever matched, and the run
    trained on reward 0 throughout (reward.name=task) with eval accuracy 0, without a word. Each entry is an accepted
    answer and the first is the reference answer. Other structures (a custom reward's test cases) match nothing."""
    task = JsonlTask(_write(tmp_path, [json.dumps({"q": "2+2?", "a": ["4", "four", 4.5]})]), None, "q", "a")
    (p,) = task.train
    assert task.score(" four ", p.label) == 1.0 and task.score("4", p.label) == 1.0 and task.score("4.5", p.label) == 1.0
    assert task.score("5", p.label) == 0.0 and task.reference(p) == "4"
    assert task.score("4", [["4"]]) == 0.0 and task.score("4", {"answer": "4"}) == 0.0 and task.score("", []) == 0.0
    assert task.reference(dataclasses.replace(p, label=[])) is None


def test_an_empty_prompt_is_named_at_start_up(tmp_path):
    """The engines refuse a prompt of no tokens; found by the loop, that failed mid-run without the file's line."""
    path = _write(tmp_path, [json.dumps({"q": "ok"}), json.dumps({"q": "", "a": 1})])
    with pytest.raises(DataError, match=r"d.jsonl:2: 'q' is empty"):
        read_prompts(path, "q", "a")
    chat = _write(tmp_path, [json.dumps({"q": "", "messages": [{"role": "user", "content": "hi"}]})], "chat.jsonl")
    assert read_prompts(chat, "q", "a")[0].metadata["messages"][0]["content"] == "hi"  # the loop renders the messages


def test_a_line_that_is_not_utf8_is_named_and_a_byte_order_mark_is_skipped(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"q": "ok", "r": "ko"}).encode() + b"\n" + '{"q": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 \(invalid continuation byte at byte 10\)"):
        read_prompts(str(path), "q", "a")
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8"):  # the SFT reader too
        read_sft_examples(str(path), "q", "r", CharTokenizer())
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps({"q": "héllo"}, ensure_ascii=False).encode() + b"\r\n")
    assert [p.text for p in read_prompts(str(bom), "q", "a")] == ["héllo"]


@pytest.mark.parametrize("messages, message", [
    ("hi", r"d.jsonl:1: 'messages' must be a non-empty list"),
    ([], r"d.jsonl:1: 'messages' must be a non-empty list"),
    ([["user", "hi"]], r"d.jsonl:1: 'messages'\[0\] must be an object with string 'role' and 'content'"),
    ([{"role": "user"}], r"d.jsonl:1: 'messages'\[0\] must be an object with string 'role' and 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}], r"d.jsonl:1: 'messages'\[1\] must be"),
])
def test_malformed_chat_messages_are_named_at_start_up(tmp_path, messages, message):
    """The loop renders ``messages`` with the model's chat template when it first tokenizes the prompt: a malformed
    list passed the start-up check, then the template raised (TypeError, jinja2's UndefinedError) with a traceback."""
    path = _write(tmp_path, [json.dumps({"q": "", "messages": messages, "a": 1})])
    with pytest.raises(DataError, match=message):
        read_prompts(path, "q", "a")


def test_an_sft_example_with_an_empty_prompt_is_named_at_start_up(tmp_path):
    """A response is trained from the positions before its tokens: with no prompt token, its first token was predicted
    from position -1 of the packed row, the last token of another example."""
    path = _write(tmp_path, [json.dumps({"q": "x?", "r": "cd"}), json.dumps({"q": "", "r": "ab"})])
    with pytest.raises(DataError, match=r"d.jsonl:2: 'q' is empty"):
        read_sft_examples(path, "q", "r", CharTokenizer())
    ok = read_sft_examples(_write(tmp_path, [json.dumps({"q": "x?", "r": "cd"})], "ok.jsonl"), "q", "r", CharTokenizer())
    assert [(s.prompt_ids, s.response_ids, s.loss_mask) for s in ok] == [([49, 21], [28, 29, 1], [1, 1, 1])]


def test_contains_answer_scores_the_label_and_refuses_an_empty_one():
    """An empty or whitespace label (from a task other than jsonl, whose reader refuses it) gave every response
    reward 1.0: every string contains ''. It is now an error naming the sample."""
    from miles_core.rewards.plugin import contains_answer
    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.types import Sample

    def sample(response, label, index=0):
        return Sample("what is 6*7?", [1], [2], response, [], label=label, index=index)

    assert score_samples(contains_answer, "contains_answer", [sample("so it is 42.", 42), sample("41", " 42 ", 1),
                                                              sample("no label", None, 2)], 30.0) == [1.0, 0.0, 0.0]
    with pytest.raises(RewardError, match=r"^reward 'contains_answer' raised ValueError: the label is empty .*"
                                          r"\(sample 3, prompt 'what is 6\*7\?'\)"):
        score_samples(contains_answer, "contains_answer", [sample("42", 42), sample("anything", "  ", 3)], 30.0)


def test_exact_match_and_contains_answer_refuse_a_label_that_is_not_a_text_or_number():
    """reasoning_gym's label is the dataset entry (a dict) and a JSONL label may be a list of answers: exact_match and
    contains_answer compared the response with str(label) ("{'question': ...}", "['42', 'forty-two']"), so every
    response scored 0.0 and the run trained on all-zero rewards without a word. It is now an error naming the sample."""
    from miles_core.rewards.plugin import contains_answer, exact_match
    from miles_core.rewards.runner import RewardError, score_samples
    from miles_core.types import Sample

    entry = {"question": "6*7?", "answer": "42", "metadata": {}}
    for fn in (exact_match, contains_answer):
        ok = [Sample("6*7?", [1], [2], "42", [], label=label, index=i) for i, label in enumerate(("42", 42, 42.5))]
        assert score_samples(fn, fn.__name__, ok, 30.0) == [1.0, 1.0, 0.0]
        for label, kind in ((entry, "dict"), (["42", "forty-two"], "list")):
            bad = [Sample("6*7?", [1], [2], "42", [], label="42"), Sample("6*7?", [1], [2], "42", [], label=label, index=1)]
            with pytest.raises(RewardError, match=rf"^reward '{fn.__name__}' raised ValueError: the label is a {kind}, "
                                                  rf"not a text or number .*\(sample 1, prompt '6\*7\?'\)$"):
                score_samples(fn, fn.__name__, bad, 30.0)
