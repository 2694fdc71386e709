import http.client
import json

import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
    from miles_core.models.checkpoint import save_hf_folder
    from miles_core.models.decoder import Decoder, DecoderConfig
    from miles_core.plugins.manager import MilesPlugins

    torch.manual_seed(0)
    tok = CharTokenizer()
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64))
    with torch.no_grad():  # larger than the default init, so greedy outputs vary with the prompt
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("serve") / "tiny"
    family = MilesPlugins().registries.model_families.get("llama")
    save_hf_folder(model, family, path, {CHAR_TOKENIZER_FILE: tok.to_json()})
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.serve.app import build_server

    srv = build_server(str(model_dir), port=0, device="cpu", engine=EngineConfig(block_size=4, decode_steps=2, max_num_seqs=16),
                       max_request_bytes=1 << 16)
    srv.start()
    yield srv
    srv.shutdown()


class Client:
    def __init__(self, port: int) -> None:
        self.port = port

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, headers=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        conn.close()
        try:
            return resp.status, json.loads(payload)
        except json.JSONDecodeError:
            return resp.status, payload.decode()

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def stream(self, path, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        events = []
        for line in resp:
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[6:]
                if data == b"[DONE]":
                    break
                events.append(json.loads(data))
        conn.close()
        return events


@pytest.fixture
def client(server):
    return Client(server.port)


@pytest.fixture
def client_for():
    """A :class:`Client` for any server's port (a fixture, since a test module importing from ``conftest``
    gets whichever conftest pytest imported last)."""
    return Client
