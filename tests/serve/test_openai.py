"""`miles serve`'s OpenAI-compatible endpoints over loopback: each answer is what SGLang's /generate
gives for the same prompt and sampling, and a stream's deltas join to the non-streamed answer."""

import pytest
import torch


def generate(client, prompt, **sampling):
    key = "text" if isinstance(prompt, str) else "input_ids"
    status, out = client.post("/generate", {key: prompt, "sampling_params": sampling, "return_logprob": True})
    assert status == 200, out
    return out


def chat_prompt(server, messages):
    # the served tokenizer (the character tokenizer) has no chat template: "role: content" lines, then "assistant:"
    return server.tokenizer.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:")


def test_models_lists_the_served_model(client, server):
    status, out = client.request("GET", "/v1/models")
    assert status == 200 and out["object"] == "list"
    assert [m["id"] for m in out["data"]] == [server.model_path]


def test_completions_match_generate(client, server):
    status, out = client.post("/v1/completions", {"prompt": "3+3=", "max_tokens": 4, "temperature": 0, "logprobs": 2})
    assert status == 200 and out["object"] == "text_completion"
    ref = generate(client, "3+3=", max_new_tokens=4, temperature=0)
    (choice,) = out["choices"]
    assert choice["text"] == ref["text"] and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    lps = choice["logprobs"]
    assert lps["token_logprobs"] == pytest.approx([lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert lps["tokens"] == [server.tokenizer.decode([t]) for t in ref["output_ids"]]
    for row, lp in zip(lps["top_logprobs"], lps["token_logprobs"]):  # greedy: the chosen token is the top one
        assert 1 <= len(row) <= 2 and max(row.values()) == lp
    by_ids = client.post("/v1/completions", {"prompt": server.tokenizer.encode("3+3="), "max_tokens": 4, "temperature": 0})[1]
    assert by_ids["choices"][0]["text"] == ref["text"] and by_ids["choices"][0]["logprobs"] is None


def test_completions_seed_n_and_stop(client):
    body = {"prompt": "1+", "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 2}
    a, b = client.post("/v1/completions", body)[1], client.post("/v1/completions", body)[1]
    assert [c["index"] for c in a["choices"]] == [0, 1]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # seeded: reproducible
    ref = [generate(client, "1+", max_new_tokens=8, temperature=1.0, sampling_seed=5 + i, n=1)["text"] for i in range(2)]
    assert [c["text"] for c in a["choices"]] == ref  # sample i of a seeded group draws with seed + i
    assert a["usage"]["completion_tokens"] == 16
    full = generate(client, "3+3=", max_new_tokens=8, temperature=0)["text"]
    stop = full[3:5]
    out = client.post("/v1/completions", {"prompt": "3+3=", "max_tokens": 8, "temperature": 0, "stop": [stop]})[1]
    assert out["choices"][0]["text"] == full[: full.find(stop)] and out["choices"][0]["finish_reason"] == "stop"


def test_completions_top_p_max_completion_tokens_and_logprobs_zero(client):
    greedy = generate(client, "2+", max_new_tokens=6, temperature=0)
    # top_p tiny keeps only the top token: a seeded draw at temperature 1 is the greedy answer
    body = {"prompt": "2+", "max_tokens": 6, "temperature": 1.0, "seed": 3, "top_p": 1e-6}
    assert client.post("/v1/completions", body)[1]["choices"][0]["text"] == greedy["text"]
    assert client.post("/v1/completions", {**body, "top_p": 1.0})[1]["choices"][0]["text"] != greedy["text"]
    out = client.post("/v1/completions", {"prompt": "2+", "max_completion_tokens": 3, "max_tokens": 6, "temperature": 0, "logprobs": 0})[1]
    assert out["usage"]["completion_tokens"] == 3  # max_completion_tokens wins over the older max_tokens
    lps = out["choices"][0]["logprobs"]  # logprobs=0: the sampled tokens' logprobs, no alternatives
    assert lps["token_logprobs"] == pytest.approx([lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"][:3]], abs=1e-5)
    assert lps["top_logprobs"] is None


def test_chat_answers_the_rendered_prompt(client, server):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2"}]
    status, out = client.post("/v1/chat/completions", {"messages": messages, "max_tokens": 5, "temperature": 0,
                                                        "logprobs": True, "top_logprobs": 2})
    assert status == 200 and out["object"] == "chat.completion"
    ref = generate(client, chat_prompt(server, messages), max_new_tokens=5, temperature=0)
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": ref["text"]}
    content = choice["logprobs"]["content"]
    # within float error: the second request reuses the first's cached prompt pages (computed in another chunking)
    assert [c["logprob"] for c in content] == pytest.approx([lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)
    assert out["usage"]["prompt_tokens"] == len(chat_prompt(server, messages))
    two = client.post("/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 1.0, "seed": 3, "n": 2})[1]
    assert [c["index"] for c in two["choices"]] == [0, 1] and all(c["message"]["role"] == "assistant" for c in two["choices"])


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("stop_at", [None, 2, 5])
def test_stream_deltas_join_to_the_answer(client, server, chat, stop_at):
    """Deltas are cut from text later tokens cannot change: a possible start of a stop string is held back
    (sent early, it would be in the joined stream but not in the final answer)."""
    prompt = {"messages": [{"role": "user", "content": "12*3"}]} if chat else {"prompt": "12*3="}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**prompt, "max_tokens": 12, "temperature": 0}
    if stop_at is not None:
        full = client.post(path, body)[1]["choices"][0]
        text = full["message"]["content"] if chat else full["text"]
        body["stop"] = [text[stop_at: stop_at + 3]]
        assert len(body["stop"][0]) == 3, text
    final = client.post(path, body)[1]["choices"][0]
    events = client.stream(path, {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] if chat else e["choices"][0] for e in events]
    joined = "".join(d.get("content", "") if chat else d["text"] for d in deltas)
    assert joined == (final["message"]["content"] if chat else final["text"])
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + [final["finish_reason"]]
    assert final["finish_reason"] == ("length" if stop_at is None else "stop")
    if chat:
        assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
        assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_bad_requests_name_the_field(client):
    for path, body, reason in [
        ("/v1/chat/completions", {"messages": "hi"}, "'messages'"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "'messages'"),
        ("/v1/completions", {"prompt": ""}, "'prompt'"),
        ("/v1/completions", {"prompt": [1, "a"]}, "'prompt'"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, "'logprobs'"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1000}, "'top_logprobs'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1}, "'top_logprobs'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": "3"}, "'top_logprobs'"),
        # OpenAI refuses top_logprobs without logprobs; it was ignored, and the client got no logprobs at all
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
    ]:
        status, out = client.post(path, body)
        assert status == 400 and reason in out["error"]["message"], (path, body, out)


def test_max_tokens_absent_zero_and_null(client, server):
    """As SGLang's OpenAI server (and OpenAI's API): a completion without max_tokens makes at most 16 tokens, a chat
    completion runs to its end (a stop, or the context); max_tokens 0 is refused, not read as absent; null is absent."""
    out = client.post("/v1/completions", {"prompt": "5*5=", "temperature": 0, "stop": ["never"]})[1]
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"
    assert client.post("/v1/completions", {"prompt": "5*5=", "temperature": 0, "max_tokens": None})[1]["usage"]["completion_tokens"] == 16
    for path, body in [("/v1/completions", {"prompt": "5*5="}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        for key in ("max_tokens", "max_completion_tokens"):
            status, res = client.post(path, {**body, key: 0})
            assert status == 400 and f"'{key}'" in res["error"]["message"], (path, key, res)
    messages = [{"role": "user", "content": "5*5"}]
    status, out = client.post("/v1/chat/completions", {"messages": messages, "temperature": 0})
    ref = generate(client, chat_prompt(server, messages), max_new_tokens=server.engine.core.max_model_len, temperature=0)
    assert status == 200 and out["choices"][0]["message"]["content"] == ref["text"]
    assert out["usage"]["completion_tokens"] == ref["meta_info"]["completion_tokens"] > 128  # not cut at a default


def test_a_flag_that_is_not_a_boolean_is_a_400(client):
    """``stream: "false"`` streamed server-sent events to a client that asked for one JSON answer; ``logprobs: "no"``
    on a chat returned logprobs."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body, reason in [
        ("/v1/completions", {"prompt": "a", "max_tokens": 2, "stream": "false"}, "'stream' must be true or false"),
        ("/v1/chat/completions", {**chat, "stream": 0}, "'stream' must be true or false"),
        ("/v1/chat/completions", {**chat, "logprobs": "no"}, "'logprobs' must be true or false"),
    ]:
        status, out = client.post(path, body)
        assert status == 400 and reason in out["error"]["message"], (path, body, out)
    status, out = client.post("/v1/chat/completions", {**chat, "stream": None, "logprobs": None})
    assert status == 200 and out["object"] == "chat.completion" and out["choices"][0]["logprobs"] is None


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A server whose model folder has an HF tokenizer with a Gemma-like chat template (no system role)."""
    from miles_core.data.tokenizer import HFTokenizer
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.testing.tokenizers import GEMMA_LIKE, byte_level_bpe
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.serve.app import build_server

    tok = HFTokenizer.wrap(byte_level_bpe("<user>what is 2+2<assistant>4", repeat=5, chat_template=GEMMA_LIKE))
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64))
    path = tmp_path_factory.mktemp("serve") / "templated"
    save_hf_folder(model, MilesPlugins().registries.model_families.get("llama"), path, tok.files())
    srv = build_server(str(path), port=0, device="cpu", engine=EngineConfig(block_size=4, decode_steps=2))
    srv.start()
    yield srv
    srv.shutdown()


def test_chat_renders_the_model_s_chat_template(templated, client_for):
    """The prompt is the chat template's text, tokenized (transformers 5's apply_chat_template(tokenize=True) gives a
    BatchEncoding, whose list was its keys); a template that refuses the messages is a 400 naming why, not a 500."""
    client = client_for(templated.port)
    messages = [{"role": "user", "content": "what is 2+2"}]
    status, out = client.post("/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0})
    assert status == 200, out
    ids = templated.tokenizer.encode("<user>what is 2+2<assistant>")
    assert out["usage"]["prompt_tokens"] == len(ids)
    ref = generate(client, ids, max_new_tokens=4, temperature=0)
    assert out["choices"][0]["message"]["content"] == ref["text"]
    status, out = client.post("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"}, *messages]})
    assert status == 400, out
    assert "chat template" in out["error"]["message"] and "System role not supported" in out["error"]["message"]


def test_sampling_knobs_are_honoured_or_refused_not_ignored(client):
    """SGLang's OpenAI endpoints take its sampling extras (top_k, min_p, stop_token_ids, ignore_eos) beside OpenAI's
    fields; they were dropped silently, as were OpenAI's penalties and logit_bias, so a request ran with other
    sampling than it asked for. The extras now apply as on /generate; what the engine cannot do is a 400 naming it."""
    greedy = generate(client, "7*", max_new_tokens=8, temperature=0)
    out = client.post("/v1/completions", {"prompt": "7*", "max_tokens": 8, "temperature": 1.0, "seed": 4, "top_k": 1})[1]
    assert out["choices"][0]["text"] == greedy["text"]  # top_k=1 keeps the top token only: greedy
    free = generate(client, "7*", max_new_tokens=8, temperature=1.0, sampling_seed=4)
    assert free["text"] != greedy["text"]  # (without top_k the seeded draw differs, so the equality means something)
    ref = generate(client, "7*", max_new_tokens=8, temperature=1.0, sampling_seed=4, min_p=0.2)
    out = client.post("/v1/completions", {"prompt": "7*", "max_tokens": 8, "temperature": 1.0, "seed": 4, "min_p": 0.2})[1]
    assert out["choices"][0]["text"] == ref["text"]
    stop_id = greedy["output_ids"][2]
    out = client.post("/v1/completions", {"prompt": "7*", "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]})[1]
    assert out["usage"]["completion_tokens"] == greedy["output_ids"].index(stop_id) + 1 <= 3
    assert out["choices"][0]["finish_reason"] == "stop"
    chat = {"messages": [{"role": "user", "content": "7*"}], "max_tokens": 2}
    for key, value in [("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("repetition_penalty", 1.2),
                       ("min_tokens", 2), ("logit_bias", {"5": 100})]:
        for path, body in [("/v1/completions", {"prompt": "7*", "max_tokens": 2}), ("/v1/chat/completions", chat)]:
            status, res = client.post(path, {**body, key: value})
            assert status == 400 and key in res["error"]["message"], (path, key, res)
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0, "logit_bias": {}}
    assert client.post("/v1/completions", {"prompt": "7*", "max_tokens": 8, "temperature": 0, **neutral})[1]["choices"][0]["text"] == greedy["text"]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_carries_the_logprobs_it_was_asked_for(client, chat):
    """A stream with logprobs had none in any chunk (the request's logprobs were dropped without a word); each chunk now
    carries the logprobs of the tokens since the previous one, so that joined they are the non-streamed answer's."""
    if chat:
        body = {"messages": [{"role": "user", "content": "9*9"}], "logprobs": True, "top_logprobs": 2}
    else:
        body = {"prompt": "9*9=", "logprobs": 2}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "max_tokens": 10, "temperature": 0}
    final = client.post(path, body)[1]["choices"][0]["logprobs"]
    events = client.stream(path, {**body, "stream": True})
    parts = [e["choices"][0]["logprobs"] for e in events]
    if chat:
        joined = [c for p in parts for c in p["content"]]
        assert [c["token"] for c in joined] == [c["token"] for c in final["content"]] and len(joined) == 10
        assert [c["logprob"] for c in joined] == pytest.approx([c["logprob"] for c in final["content"]], abs=1e-5)
        assert [len(c["top_logprobs"]) for c in joined] == [2] * 10
    else:
        assert [t for p in parts for t in p["tokens"]] == final["tokens"] and len(final["tokens"]) == 10
        assert [lp for p in parts for lp in p["token_logprobs"]] == pytest.approx(final["token_logprobs"], abs=1e-5)
        assert [len(row) for p in parts for row in p["top_logprobs"]] == [len(row) for row in final["top_logprobs"]]
    plain = client.stream(path, {**body, "stream": True, "logprobs": False if chat else None, "top_logprobs": None})
    assert all(e["choices"][0].get("logprobs") is None for e in plain)
