"""`miles serve` on an architecture with no Miles family (Qwen2 here): it loads through transformers
and answers SGLang's /generate and the OpenAI route over loopback with transformers' own greedy tokens."""

import pytest
import torch


@pytest.fixture(scope="module")
def qwen2_server(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from miles_core.data.tokenizer import CHAR_TOKENIZER_FILE, CharTokenizer
    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.serve.app import build_server

    tok = CharTokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("serve-hf") / "qwen2"
    hf.save_pretrained(path)
    (path / CHAR_TOKENIZER_FILE).write_text(tok.to_json())
    srv = build_server(str(path), port=0, device="cpu", engine=EngineConfig(block_size=4, decode_steps=2, max_num_seqs=8))
    srv.start()
    yield srv, hf, tok
    srv.shutdown()


def test_generate_matches_transformers(qwen2_server, client_for):
    srv, hf, tok = qwen2_server
    client = client_for(srv.port)
    assert type(srv.engine.core.runner).__name__ == "TransformersRunner"
    refs = {}
    for text in ("12+34=", "7*8="):
        ids = tok.encode(text)
        x = torch.tensor([ids])
        ref = refs[text] = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        status, out = client.post("/generate", {"text": text, "return_logprob": True,
                                                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
        assert status == 200
        assert out["output_ids"] == ref
        with torch.no_grad():
            logits = hf(torch.tensor([ids + ref])).logits[0, len(ids) - 1 : -1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ref)[:, None])[:, 0]
        got = torch.tensor([v for v, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(got, lp, atol=1e-5, rtol=0)
    assert refs["12+34="] != refs["7*8="]
    status, body = client.post("/v1/completions", {"prompt": "12+34=", "max_tokens": 8, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == tok.decode(refs["12+34="])
