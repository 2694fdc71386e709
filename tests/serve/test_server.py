"""`miles serve` over loopback with a real HTTP client (http.client): SGLang's endpoints, malformed and
oversized requests, streaming, and aborts in mid-generation (OpenAI's endpoints: test_openai.py)."""

import base64
import http.client
import json
import socket
import threading
import time

import pytest
import torch

from miles_core.rollout.base import SamplingParams

GREEDY = {"max_new_tokens": 6, "temperature": 0}


def engine_ref(server, ids, params):
    """The same request run straight on the engine core (through its thread)."""
    reqs, sink = server.engine.submit(ids, params, None)
    while not sink.get().finished:
        pass
    return reqs[0]


def raw_post(port: int, path: str, headers: bytes, body: bytes) -> tuple[int, dict]:
    """POST with hand-written headers (http.client would set a true Content-Length) and the start of a body, the
    connection left open: the status and JSON answer. A server that waits for more body times out here."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read())


def test_health_and_model_info(client, server):
    assert server.httpd.server_address[0] == "127.0.0.1"  # loopback unless --host says otherwise
    assert client.request("GET", "/health") == (200, "")
    assert client.request("GET", "/health_generate")[0] == 200
    status, info = client.request("GET", "/get_model_info")
    assert status == 200 and info["is_generation"] and info["weight_version"] == str(server.engine.core.weight_version)
    assert info["max_model_len"] == server.engine.core.max_model_len and info["paused"] is False


def test_generate_text_and_ids_with_logprobs(client, server):
    tok = server.tokenizer
    status, out = client.post("/generate", {"text": "12+34=", "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2})
    assert status == 200
    ref = engine_ref(server, tok.encode("12+34="), SamplingParams(max_new_tokens=6, temperature=0))
    assert out["output_ids"] == ref.output_ids
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 6 and meta["completion_tokens"] == 6
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.output_ids
    assert torch.allclose(torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]]), torch.tensor(ref.logprobs), atol=1e-6)
    assert all(row[0][1] == t for row, t in zip(meta["output_top_logprobs"], ref.output_ids))  # greedy = top-1
    assert out["text"] == tok.decode(ref.output_ids)
    status, by_ids = client.post("/generate", {"input_ids": tok.encode("12+34="), "sampling_params": GREEDY})
    assert by_ids["output_ids"] == ref.output_ids


def test_batch_and_n_keep_order(client):
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": [{"max_new_tokens": 3, "n": 2, "sampling_seed": 1}, {"max_new_tokens": 4}], "rid": ["a", "b"]}
    status, outs = client.post("/generate", body)
    assert status == 200
    assert [o["meta_info"]["id"] for o in outs] == ["a-0", "a-1", "b"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 3, 4]


def test_stream_events_grow_to_the_final_answer(client):
    events = client.stream("/generate", {"text": "7*8=", "sampling_params": {"max_new_tokens": 7, "temperature": 0}, "stream": True})
    status, final = client.post("/generate", {"text": "7*8=", "sampling_params": {"max_new_tokens": 7, "temperature": 0}})
    assert len(events) >= 2
    assert events[-1]["output_ids"] == final["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    lens = [len(e["output_ids"]) for e in events]
    assert lens == sorted(lens) and len(set(lens)) == len(lens)  # every event adds tokens
    for e in events:  # each event is a prefix of the answer, in ids and in text
        assert e["output_ids"] == final["output_ids"][: len(e["output_ids"])]
        assert final["text"].startswith(e["text"]) and e["meta_info"]["completion_tokens"] == len(e["output_ids"])


def test_a_client_that_hangs_up_on_a_stream_aborts_its_request(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps({"text": "4+4=", "rid": "gone", "stream": True,
                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data: " not in got:  # the stream has started
        got += sock.recv(4096)
    req = server.engine.core.requests["gone"]
    sock.close()
    deadline = time.time() + 30
    while req.finish_reason is None and time.time() < deadline:
        time.sleep(0.01)
    assert req.finish_reason == "abort" and len(req.output_ids) < 3000
    assert "gone" not in server.engine.core.requests


def test_stop_strings_over_http(client):
    sampling = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = client.post("/generate", {"text": "8+9=", "sampling_params": sampling})[1]
    stop = full["text"][4:6]
    assert len(stop) == 2
    status, out = client.post("/generate", {"text": "8+9=", "sampling_params": {**sampling, "stop": stop}})
    assert status == 200 and out["text"] == full["text"][: full["text"].find(stop)]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == full["output_ids"][: len(out["output_ids"])]  # the ids run through the stop string


def test_the_prefix_cache_and_flush_cache(client):
    body = {"text": "the same long prompt", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    client.post("/flush_cache", {})
    first = client.post("/generate", body)[1]["meta_info"]
    again = client.post("/generate", body)[1]["meta_info"]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] >= 16  # the prompt's full pages (block_size 4)
    assert client.post("/flush_cache", {}) == (200, "Cache flushed.")
    assert client.post("/generate", body)[1]["meta_info"]["cached_tokens"] == 0


def test_malformed_and_oversized_requests(client, server):
    bad = [
        (b"{not json", "malformed JSON"),
        (b'{"sampling_params": {}}', "exactly one of"),
        (b'{"text": "a", "input_ids": [1]}', "exactly one of"),
        (b'{"input_ids": ["x"]}', "input_ids"),
        (b'{"input_ids": [100000]}', "input_ids must be in"),
        (b'{"text": "a", "sampling_params": {"temperature": -1}}', "temperature"),
        (b'{"text": "a", "sampling_params": {"top_p": 0}}', "top_p"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": "5"}}', "max_new_tokens"),
        (b'{"text": "a", "sampling_params": {"colour": 1}}', "unsupported sampling_params: colour"),
        (b'[1, 2]', "JSON object"),
        (b'{"text": [], "sampling_params": {}}', "'text' must be a string or a non-empty list"),
        (b'{"input_ids": [[1, 2], []]}', "'input_ids' must be a non-empty list"),
        (b'{"input_ids": [[1], [2]], "rid": ["a"]}', "rid has 1 entries for 2 prompts"),
        (b'{"input_ids": [[1], [2]], "stream": true}', "streaming is supported for a single prompt"),
        (b'{"text": "a", "top_logprobs_num": 101, "return_logprob": true}', "top_logprobs_num"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": 0}}', "max_new_tokens=0 is out of range"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": true}}', "max_new_tokens must be an integer"),
        (b'{"text": "a", "sampling_params": {"temperature": true}}', "temperature must be a number"),
        (b'{"text": "a", "sampling_params": {"min_p": 1.5}}', "min_p=1.5 is out of range"),
        (b'{"text": "a", "sampling_params": {"top_k": -2}}', "top_k=-2 is out of range"),
        (b'{"text": "a", "sampling_params": {"n": 1025}}', "n=1025 is out of range"),
        (b'{"text": "a", "sampling_params": {"frequency_penalty": 0.5}}', "frequency_penalty is not supported"),
        (b'{"text": "a", "sampling_params": {"stop": ["x", ""]}}', "stop must be a string or a list of non-empty strings"),
        (b'{"text": "a", "sampling_params": {"stop_token_ids": [true]}}', "stop_token_ids must be a list of integers"),
        (b'{"text": "a", "sampling_params": {"sampling_seed": "7"}}', "sampling_seed must be an integer"),
        (b'{"text": "a", "return_logprob": true, "logprob_start_len": 0}', "input_token_logprobs) are not served"),
    ]
    for raw, reason in bad:
        status, body = client.post("/generate", raw=raw)
        assert status == 400, raw
        assert reason in body["error"]["message"], (raw, body)
    status, body = client.post("/generate", raw=b'{"text": "' + b"a" * (1 << 17) + b'"}')
    assert status == 413 and "exceeds the limit" in body["error"]["message"]
    small = b'{"text": "1+1=", "sampling_params": {"max_new_tokens": 1}}'
    at_limit = small + b" " * (server.max_request_bytes - len(small))  # JSON allows trailing whitespace
    assert client.post("/generate", raw=at_limit)[0] == 200
    status, body = client.post("/generate", raw=at_limit + b" ")
    assert status == 413 and f"{server.max_request_bytes + 1} bytes exceeds" in body["error"]["message"]
    assert client.post("/abort_request", {"rid": 5})[0] == 400
    # SGLang's "no input token logprobs" (-1, or absent) is served
    ok = {"text": "1+1=", "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    assert client.post("/generate", {**ok, "logprob_start_len": -1})[0] == 200
    assert client.post("/generate", {**ok, "input_ids": [[3, 4], [5]], "text": None, "logprob_start_len": [-1, None]})[0] == 200
    # nested deeper than the JSON parser's recursion limit, yet within the size bound
    status, body = client.post("/generate", raw=b"[" * 60000)
    assert status == 400 and "nested too deeply" in body["error"]["message"]
    # headers that lie about the body: a negative or non-numeric length must not read past the bound
    start = b'{"text": "' + b"a" * 1000
    for headers, want, reason in [(b"Content-Length: -1\r\n", 400, "bad Content-Length"),
                                  (b"Content-Length: ten\r\n", 400, "bad Content-Length"),
                                  (b"Transfer-Encoding: chunked\r\n", 411, "chunked")]:
        status, body = raw_post(server.port, "/generate", headers, start)
        assert status == want and reason in body["error"]["message"], (headers, status, body)
    assert client.request("GET", "/nope")[0] == 404
    assert client.request("GET", "/health")[0] == 200  # the server is still fine


def test_an_address_it_cannot_listen_on_is_a_config_error(client, server, model_dir):
    """A port in use (here: this module's server's), or not this machine's address: one error naming it, and the
    engine thread started for it is stopped again."""
    from miles_core.errors import ConfigError
    from miles_core.serve.app import build_server

    engines = lambda: sum(t.name == "miles-engine" for t in threading.enumerate())  # noqa: E731
    before = engines()
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{server.port}: .*in use"):
        build_server(str(model_dir), port=server.port, device="cpu")
    with pytest.raises(ConfigError, match="cannot listen on 10.255.255.1:0"):
        build_server(str(model_dir), host="10.255.255.1", port=0, device="cpu")
    with pytest.raises(ConfigError, match="max_request_bytes must be >= 1"):
        build_server(str(model_dir), port=0, device="cpu", max_request_bytes=0)
    assert engines() == before  # no engine thread left running
    assert client.request("GET", "/health")[0] == 200


def test_abort_in_mid_generation(client, server):
    result = {}

    def long_request():
        result["out"] = client.post("/generate", {"text": "1+1=", "rid": "long", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until it is running and has produced tokens
        req = server.engine.core.requests.get("long")
        if req is not None and len(req.output_ids) > 3:
            break
        time.sleep(0.01)
    status, body = client.post("/abort_request", {"rid": "lon"})  # a rid aborts itself and its samples (rid-i), no other
    assert status == 200 and not body["success"] and server.engine.core.requests["long"].finish_reason is None
    status, body = client.post("/abort_request", {"rid": "long"})
    assert status == 200 and body["success"]
    t.join(30)
    status, out = result["out"]
    assert status == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 < out["meta_info"]["completion_tokens"] < 1500


def test_pause_and_continue(client, server):
    assert client.post("/pause_generation", {"mode": "in_place"})[0] == 200
    assert client.request("GET", "/get_model_info")[1]["paused"] is True
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", client.post("/generate", {"text": "5", "rid": "held", "sampling_params": GREEDY})))
    t.start()
    time.sleep(0.3)
    assert "out" not in result  # held while paused: queued, nothing generated
    assert server.engine.core.requests["held"].output_ids == []
    assert client.post("/continue_generation", {})[0] == 200
    t.join(30)
    assert result["out"][0] == 200 and result["out"][1]["meta_info"]["completion_tokens"] == 6


def _long_generation(client, server, text: str, rid: str) -> tuple[threading.Thread, dict]:
    """A 3000-token /generate on a thread, returned once it has decoded more than 3 tokens; its answer lands in the dict."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("out", client.post(
        "/generate", {"text": text, "rid": rid, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and len(getattr(server.engine.core.requests.get(rid), "output_ids", ())) <= 3:
        time.sleep(0.01)
    return t, result


def test_pause_in_abort_mode_ends_running_requests(client, server):
    t, result = _long_generation(client, server, "6", "cut")
    assert client.post("/pause_generation", {})[0] == 200  # mode defaults to abort, as SGLang's
    t.join(30)
    status, out = result["out"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 < out["meta_info"]["completion_tokens"] < 3000
    assert client.post("/continue_generation", {})[0] == 200
    assert client.post("/generate", {"text": "6", "sampling_params": GREEDY})[1]["meta_info"]["completion_tokens"] == 6
    assert client.post("/pause_generation", {"mode": "sideways"})[0] == 400


def test_pause_in_retract_mode_keeps_running_requests(client, server):
    t, result = _long_generation(client, server, "3", "kept")
    req = server.engine.core.requests["kept"]
    try:
        assert client.post("/pause_generation", {"mode": "retract"})[0] == 200
        assert req.finish_reason is None  # not aborted (the abort mode ends requests before it answers)
        time.sleep(0.3)  # a decode window in flight may still land
        held = len(req.output_ids)
        time.sleep(0.2)
        assert req.finish_reason is None and len(req.output_ids) == held  # held
    finally:
        assert client.post("/continue_generation", {})[0] == 200
    deadline = time.time() + 30
    while time.time() < deadline and len(req.output_ids) <= held:  # it goes on
        time.sleep(0.01)
    assert len(req.output_ids) > held and req.finish_reason is None
    assert client.post("/abort_request", {"rid": "kept"})[1]["success"]
    t.join(30)
    assert result["out"][0] == 200 and result["out"][1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_generate_fields_map_onto_the_engine_s_sampling_params():
    from miles_core.serve.protocol import parse_generate

    body = {"input_ids": [1, 2], "top_logprobs_num": 2,
            "sampling_params": {"n": 3, "ignore_eos": True, "sampling_seed": 5, "seed": 9, "top_k": -1, "min_p": 0.1, "stop_token_ids": [4]}}
    (it,), batch, stream = parse_generate(body, None)
    assert batch and not stream and it.n == 3  # n > 1: the answer is a list, as for a batch
    p = it.params
    assert p.ignore_eos and p.seed == 5 and p.top_k == 0 and p.min_p == 0.1 and p.stop_token_ids == [4]
    assert p.top_logprobs == 0 and not it.return_logprob  # top logprobs only come with return_logprob
    body = {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 2, "sampling_params": {"seed": 9, "top_k": 5}}
    (it,), batch, _ = parse_generate(body, None)
    assert not batch and it.params.top_logprobs == 2 and it.params.seed == 9 and it.params.top_k == 5


def test_weight_updates_memory_and_cache(client, server, model_dir, tmp_path):
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.plugins.manager import MilesPlugins

    body = {"text": "9-4=", "sampling_params": GREEDY}
    before = client.post("/generate", body)[1]["output_ids"]
    model = server.engine.core.model
    name = "model.embed_tokens.weight"
    old = model.state_dict()[name].clone()
    new = torch.randn_like(old) * 0.3
    payload = {"named_tensors": [{"name": name, "dtype": "float32", "shape": list(new.shape),
                                  "data": base64.b64encode(new.numpy().tobytes()).decode()}], "weight_version": 3}
    status, res = client.post("/update_weights_from_tensor", payload)
    assert status == 200 and res["weight_version"] == "3"
    assert torch.equal(model.state_dict()[name], new)
    after = client.post("/generate", body)[1]
    assert after["meta_info"]["weight_version"] == "3" and after["output_ids"] != before
    status, res = client.post("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": 4})
    assert status == 200 and res["weight_version"] == "4"
    assert client.post("/generate", body)[1]["output_ids"] == before
    assert client.post("/update_weights_from_tensor", {"named_tensors": [{"name": "x"}]})[0] == 400
    assert client.post("/update_weights_from_tensor", {"named_tensors": [], "weight_version": 9})[0] == 400
    status, res = client.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and "has no *.safetensors file" in res["error"]["message"]
    (tmp_path / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes()[:100])  # cut short
    status, res = client.post("/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and "is not a readable safetensors file" in res["error"]["message"]
    assert client.post("/generate", body)[1]["output_ids"] == before  # the weights are as they were
    assert client.post("/release_memory_occupation", {})[0] == 200
    assert client.post("/generate", body)[0] == 400  # released: refused with the reason
    assert client.post("/resume_memory_occupation", {})[0] == 200
    assert client.post("/generate", body)[1]["output_ids"] == before
    assert client.post("/flush_cache", {})[0] == 200


def test_stream_event_of_a_request_the_engine_has_since_finished():
    """A stream event describes the tokens its output carried, not the live request: the engine thread
    can finish the request before the HTTP thread writes an earlier event (a CI failure under load,
    2026-12-04: an intermediate event showed finish_reason 'length')."""
    from miles_core.rollout.engine_core.request import Request
    from miles_core.serve.protocol import response

    req = Request("r", [1, 2], SamplingParams(max_new_tokens=5, top_logprobs=1), 0, frozenset())
    req.output_ids, req.logprobs = [7, 8, 9, 10, 11], [-0.1, -0.2, -0.3, -0.4, -0.5]
    req.top_logprobs = [[(t, lp)] for t, lp in zip(req.output_ids, req.logprobs)]
    req.finish_reason = "length"
    ev = response(req, "partial text", True, 0, 0.0, partial=2)
    assert ev["output_ids"] == [7, 8] and ev["meta_info"]["completion_tokens"] == 2
    assert ev["meta_info"]["finish_reason"] is None
    assert [t for _, t, _ in ev["meta_info"]["output_token_logprobs"]] == [7, 8]
    assert len(ev["meta_info"]["output_top_logprobs"]) == 2
    final = response(req, "full", True, 0, 0.0)
    assert final["output_ids"] == req.output_ids and final["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_a_weight_update_does_not_leave_old_pages_in_the_prefix_cache(client, server, model_dir):
    """Pages of a request running across a weight update hold K/V from the old weights (and K/V computed over
    them): when it ends, they must not be cached, or the next request with that prompt reuses the old K/V."""
    prompt = "a prompt of several full pages"
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    name = "model.layers.0.self_attn.v_proj.weight"
    new = server.engine.core.model.state_dict()[name] * -2
    update = {"named_tensors": [{"name": name, "dtype": "float32", "shape": list(new.shape),
                                 "data": base64.b64encode(new.numpy().tobytes()).decode()}]}
    assert client.post("/flush_cache", {})[0] == 200
    t, result = _long_generation(client, server, prompt, "across")
    try:
        assert client.post("/update_weights_from_tensor", update)[0] == 200
    finally:
        assert client.post("/abort_request", {"rid": "across"})[1]["success"]
        t.join(30)
    after = client.post("/generate", body)[1]
    assert client.post("/flush_cache", {})[0] == 200
    fresh = client.post("/generate", body)[1]
    assert client.post("/update_weights_from_disk", {"model_path": str(model_dir)})[0] == 200  # the module's weights back
    assert after["meta_info"]["cached_tokens"] == 0  # nothing the old weights computed is reused
    assert after["output_ids"] == fresh["output_ids"]


def test_a_refused_prompt_leaves_none_of_its_request_running(client, server):
    """A batch with a bad prompt, or an n-group with a taken sample id, is refused whole: the prompts and
    samples queued before the refusal do not run on unseen, holding their ids."""
    core = server.engine.core
    long = {"max_new_tokens": 3000, "ignore_eos": True}
    status, out = client.post("/generate", {"input_ids": [[5, 6, 7], [100000]], "rid": ["first", "second"], "sampling_params": long})
    assert status == 400 and "input_ids must be in" in out["error"]["message"]
    assert "first" not in core.requests
    status, out = client.post("/generate", {"input_ids": [5, 6, 7], "rid": "first", "sampling_params": GREEDY})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 6  # its id is free
    t, result = _long_generation(client, server, "7", "grp-1")
    try:
        status, out = client.post("/generate", {"text": "7", "rid": "grp", "sampling_params": {**long, "n": 2}})
        assert status == 400 and "'grp-1' is already in use" in out["error"]["message"]
        assert "grp-0" not in core.requests
    finally:
        assert client.post("/abort_request", {"rid": "grp-1"})[1]["success"]
        t.join(30)


def test_each_sample_reports_the_weight_version_it_finished_under(client, server, model_dir):
    """A batch answers when its last prompt ends: a prompt that ended before a weight update reports the version
    it was generated with, not the one loaded since."""
    core = server.engine.core
    result = {}
    body = {"input_ids": [[5, 6], [7, 8]], "rid": ["early", "late"],
            "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True}, {"max_new_tokens": 3000, "ignore_eos": True}]}
    t = threading.Thread(target=lambda: result.setdefault("out", client.post("/generate", body)))
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and ("early" in core.requests or "late" not in core.requests):
        time.sleep(0.01)
    before = core.weight_version
    try:
        status, res = client.post("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": before + 1})
        assert status == 200 and res["weight_version"] == str(before + 1)
    finally:
        assert client.post("/abort_request", {"rid": "late"})[1]["success"]
        t.join(30)
    status, (early, late) = result["out"]
    assert status == 200 and early["meta_info"]["completion_tokens"] == 2
    assert early["meta_info"]["weight_version"] == str(before) and late["meta_info"]["weight_version"] == str(before + 1)


def test_a_client_that_hangs_up_on_a_plain_generate_aborts_its_requests(server, client):
    """As SGLang does: a client that closes its connection before the answer (a timeout, say) ends its requests
    instead of leaving them to run to max_new_tokens holding pages and their rids. Paused, so nothing ends by itself."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps({"text": "4+4=", "rid": "hung", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True, "n": 2}}).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    core = server.engine.core
    deadline = time.time() + 30
    while time.time() < deadline and len(getattr(core.requests.get("hung-1"), "output_ids", ())) <= 3:
        time.sleep(0.01)
    reqs = [core.requests["hung-0"], core.requests["hung-1"]]
    assert client.post("/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        sock.close()
        deadline = time.time() + 30
        while time.time() < deadline and any(r.finish_reason is None for r in reqs):
            time.sleep(0.01)
        assert [r.finish_reason for r in reqs] == ["abort", "abort"]
        assert "hung-0" not in core.requests and "hung-1" not in core.requests
    finally:
        assert client.post("/continue_generation", {})[0] == 200


def test_a_stream_of_n_samples_numbers_its_events(client):
    """SGLang's stream of several samples gives each event an "index" (the sample's place in the answer list);
    a single sample's stream has none."""
    sampling = {"max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 4}
    events = client.stream("/generate", {"text": "3+", "rid": "idx", "stream": True, "sampling_params": {**sampling, "n": 3}})
    assert {e["meta_info"]["id"]: e["index"] for e in events} == {"idx-0": 0, "idx-1": 1, "idx-2": 2}
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"] is not None}
    status, outs = client.post("/generate", {"text": "3+", "sampling_params": {**sampling, "n": 3}})
    assert status == 200 and [finals[i]["output_ids"] for i in range(3)] == [o["output_ids"] for o in outs]
    assert all("index" not in e for e in client.stream("/generate", {"text": "3+", "stream": True, "sampling_params": sampling}))


def test_no_stop_trim_keeps_the_matched_stop_in_the_text(client, server):
    """SGLang's sampling_params.no_stop_trim (RL clients send it to get the exact text the tokens make): the stop
    string, or the text of a matched stop token, stays at the end of the text; without it, both are cut."""
    sampling = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = client.post("/generate", {"text": "8+9=", "sampling_params": sampling})[1]
    stop = full["text"][4:6]
    stop_id = next(t for t in full["output_ids"][3:] if server.tokenizer.decode([t]))  # a token with text
    upto = full["output_ids"].index(stop_id)
    cases = [({"stop": stop}, full["text"][: full["text"].find(stop)], stop),
             ({"stop_token_ids": [stop_id]}, server.tokenizer.decode(full["output_ids"][:upto]), server.tokenizer.decode([stop_id]))]
    for extra, text, tail in cases:
        trimmed = client.post("/generate", {"text": "8+9=", "sampling_params": {**sampling, **extra}})[1]
        kept = client.post("/generate", {"text": "8+9=", "sampling_params": {**sampling, **extra, "no_stop_trim": True}})[1]
        assert kept["output_ids"] == trimmed["output_ids"] and kept["meta_info"]["finish_reason"]["type"] == "stop"
        assert trimmed["text"] == text and kept["text"] == text + tail, (extra, kept, trimmed)
        events = client.stream("/generate", {"text": "8+9=", "stream": True, "sampling_params": {**sampling, **extra, "no_stop_trim": True}})
        assert events[-1]["text"] == text + tail
    assert client.post("/generate", {"text": "8+9=", "sampling_params": {"no_stop_trim": "yes"}})[0] == 400


def test_abort_by_rid_ends_the_group_it_named_and_no_other_request(client, server):
    """rid "g" with n=2 runs as g-0 and g-1: aborting "g" ends both; a request of its own whose rid is "g-x" runs on."""
    long = {"max_new_tokens": 3000, "ignore_eos": True}
    results: dict = {}
    threads = [threading.Thread(target=lambda rid=rid, n=n: results.setdefault(rid, client.post(
        "/generate", {"text": "2+", "rid": rid, "sampling_params": {**long, "n": n}}))) for rid, n in (("g", 2), ("g-x", 1))]
    for t in threads:
        t.start()
    core = server.engine.core
    deadline = time.time() + 30
    while time.time() < deadline and not all(len(getattr(core.requests.get(r), "output_ids", ())) > 3 for r in ("g-0", "g-1", "g-x")):
        time.sleep(0.01)
    other = core.requests["g-x"]
    status, body = client.post("/abort_request", {"rid": "g"})
    assert status == 200 and body["success"]
    for t in threads[:1]:
        t.join(30)
    status, outs = results["g"]
    assert status == 200 and [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]
    assert other.finish_reason is None  # still running
    assert client.post("/abort_request", {"rid": "g-x"})[1]["success"]
    threads[1].join(30)
    assert results["g-x"][1]["meta_info"]["finish_reason"]["type"] == "abort"



def test_abort_all_that_is_not_a_boolean_is_a_400_and_aborts_nothing(client, server):
    """``abort_all`` was read by truthiness: ``{"rid": "mine", "abort_all": "false"}`` aborted every request on the
    server (other clients' rollouts among them), not the one it named."""
    t, result = _long_generation(client, server, "4", "bystander")
    try:
        for value in ("false", 0, "no"):
            status, out = client.post("/abort_request", {"rid": "mine", "abort_all": value})
            assert status == 400 and "'abort_all' must be true or false" in out["error"]["message"], (value, out)
        assert server.engine.core.requests["bystander"].finish_reason is None  # still running
        assert client.post("/abort_request", {"rid": "mine", "abort_all": False}) == (200, {"success": False})
    finally:
        assert client.post("/abort_request", {"rid": "bystander"})[1]["success"]
        t.join(30)
    assert result["out"][1]["meta_info"]["finish_reason"]["type"] == "abort"

def test_a_weight_version_that_is_not_a_whole_number_is_a_400_and_loads_nothing(client, server, model_dir):
    """weight_version 2.7 was stored as 2 and true as 1, silently: the trainer's version and the samples' disagreed."""
    before = server.engine.core.weight_version
    for value in (2.7, True, "2.5", [3]):
        status, out = client.post("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": value})
        assert status == 400 and "weight_version must be a whole number" in out["error"]["message"], (value, out)
    assert server.engine.core.weight_version == before
    for value, want in ((before + 2, before + 2), (float(before + 3), before + 3), (str(before + 4), before + 4)):
        status, out = client.post("/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": value})
        assert status == 200 and out["weight_version"] == str(want), (value, out)


def test_health_generate_answers_503_when_nothing_can_run(client, server):
    """Paused, the one-token probe cannot run: 503 once server.health_timeout_s has passed (SGLang answers 503 after
    its 20 s), and the probe's request is aborted rather than left in the queue; after continue, 200."""
    core = server.engine.core
    server.health_timeout_s = 1.0
    try:
        assert client.post("/pause_generation", {"mode": "in_place"})[0] == 200
        t0 = time.perf_counter()
        status, _ = client.request("GET", "/health_generate")
        waited = time.perf_counter() - t0
        assert status == 503 and 1.0 <= waited < 5.0
        deadline = time.time() + 10
        while time.time() < deadline and core.requests:
            time.sleep(0.01)
        assert core.requests == {}  # the probe did not stay queued behind the pause
    finally:
        del server.health_timeout_s
        assert client.post("/continue_generation", {})[0] == 200
    assert client.request("GET", "/health_generate")[0] == 200


def test_a_fault_of_the_server_s_own_answers_500_and_the_server_serves_on(client, server, monkeypatch):
    """No real request is known to reach an unexpected exception, so one is planted in the engine's submit (the
    only stand-in in this file): the client gets a 500 naming it, not a dropped connection, and the next request works."""
    def broken(*a, **kw):
        raise RuntimeError("planted fault")

    monkeypatch.setattr(server.engine, "submit", broken)
    status, body = client.post("/generate", {"text": "1+1=", "sampling_params": GREEDY})
    assert status == 500 and body["error"]["message"] == "internal error: RuntimeError: planted fault"
    monkeypatch.undo()
    assert client.post("/generate", {"text": "1+1=", "sampling_params": GREEDY})[0] == 200


def test_a_body_that_is_not_a_json_object_is_a_400_on_every_endpoint(client):
    """The control endpoints read fields with ``body.get``: a JSON array or string there was a 500 (AttributeError)."""
    paths = ["/generate", "/abort_request", "/pause_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
             "/init_weights_update_group", "/update_weights_from_distributed", "/release_memory_occupation",
             "/resume_memory_occupation", "/v1/completions", "/v1/chat/completions"]
    for path in paths:
        for raw in (b"[1]", b'"abort_all"', b"3"):
            status, body = client.post(path, raw=raw)
            assert (status, body["error"]["message"]) == (400, "the request body must be a JSON object"), (path, raw, body)
    assert client.request("GET", "/health")[0] == 200


def test_sampling_numbers_that_are_not_finite_are_a_400(client):
    """Python's JSON parser reads NaN and Infinity: a NaN temperature sampled <pad> tokens (id 0) and answered 200."""
    for field in ("temperature", "top_p", "min_p"):
        for value in (b"NaN", b"Infinity", b"-Infinity", b"1" + b"0" * 400):  # the last: an integer no float holds
            raw = b'{"text": "1+1=", "sampling_params": {"max_new_tokens": 3, "' + field.encode() + b'": ' + value + b"}}"
            status, body = client.post("/generate", raw=raw)
            assert status == 400 and f"sampling_params.{field} must be a finite number" in body["error"]["message"], (raw, body)
    status, body = client.post("/v1/completions", raw=b'{"prompt": "1+1=", "max_tokens": 2, "temperature": NaN}')
    assert status == 400 and "temperature must be a finite number" in body["error"]["message"], body
    assert client.post("/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 3, "temperature": 1e30}})[0] == 200


def test_a_flag_that_is_not_a_boolean_is_a_400(client):
    """``bool("false")`` is True: ``ignore_eos: "false"`` ran past the end of sequence, ``return_logprob: "no"`` returned
    logprobs. A flag must be true, false or null."""
    for body, reason in [
        ({"text": "1+1=", "sampling_params": {"ignore_eos": "false"}}, "sampling_params.ignore_eos must be true or false"),
        ({"text": "1+1=", "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos must be true or false"),
        ({"text": "1+1=", "return_logprob": "no"}, "'return_logprob' must be true or false"),
        ({"input_ids": [[3], [4]], "return_logprob": [True, "yes"]}, "'return_logprob' must be true or false"),
    ]:
        status, out = client.post("/generate", body)
        assert status == 400 and reason in out["error"]["message"], (body, out)
    ok = {"text": "1+1=", "return_logprob": None, "sampling_params": {"max_new_tokens": 2, "ignore_eos": None}}
    status, out = client.post("/generate", ok)
    assert status == 200 and out["meta_info"]["completion_tokens"] <= 2 and "output_token_logprobs" not in out["meta_info"]


def test_memory_tags_that_are_not_a_list_of_strings_are_a_400(client, server):
    """``"tags": "weights"`` was iterated as characters: release answered "unknown tags ['e', 'g', ...]" and resume
    answered 200 having resumed nothing. ``tags`` must be a list of the allowed tag names."""
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        for tags in ("weights", ["weights", 3], {"weights": True}, ["weight"]):
            status, out = client.post(path, {"tags": tags})
            message = out["error"]["message"]
            assert status == 400 and "tags must be a list of" in message and "weights, kv_cache" in message, (path, tags, out)
    assert not server.engine.core.released  # nothing was released by a refused request
    assert client.post("/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert server.engine.core.released == {"kv_cache"}
    assert client.post("/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert not server.engine.core.released


def test_the_model_s_own_eos_ids_end_a_response_as_the_tokenizer_s_does(model_dir, tmp_path, client_for):
    """SGLang stops on every eos id of the checkpoint's config.json and generation_config.json (an int or a list;
    Llama 3 Instruct's <|eot_id|>, Qwen's <|endoftext|> beside <|im_end|>), not on the tokenizer's eos alone;
    ignore_eos still runs past them."""
    import shutil

    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.serve.app import build_server

    srv = build_server(str(model_dir), port=0, device="cpu", engine=EngineConfig(block_size=4, decode_steps=2))
    srv.start()
    try:
        free = client_for(srv.port).post("/generate", {"text": "8+9=", "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})[1]
    finally:
        srv.shutdown()
    ids = free["output_ids"]
    a, b = ids[2], next(t for t in range(4, 40) if t not in ids)  # a token of the answer, and one it never makes
    assert srv.tokenizer.eos_token_id not in ids[:3] and a not in ids[:2]
    path = tmp_path / "with_eos"
    shutil.copytree(model_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": b}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [b, a]}))
    srv = build_server(str(path), port=0, device="cpu", engine=EngineConfig(block_size=4, decode_steps=2))
    srv.start()
    try:
        client = client_for(srv.port)
        out = client.post("/generate", {"text": "8+9=", "sampling_params": {"max_new_tokens": 10, "temperature": 0}})[1]
        assert out["output_ids"] == ids[: ids.index(a) + 1]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": a}
        past = client.post("/generate", {"text": "8+9=", "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}})[1]
        assert past["output_ids"] == ids
    finally:
        srv.shutdown()
