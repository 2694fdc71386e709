"""The RolloutBackend interface the RL loop uses, on the new engine."""

import torch

from miles_core.data.tokenizer import CharTokenizer
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import BuiltinEngine
from miles_core.types import Prompt


def test_generate_groups_logprobs_and_versions():
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64))
    eng = BuiltinEngine(model, tok, torch.device("cpu"), seed=1)
    prompts = [Prompt(text="12+7=", label="19"), Prompt(text="3+4=", label="7")]
    samples = eng.generate(prompts, SamplingParams(max_new_tokens=5, temperature=1.0), n=3)
    assert [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1] and [s.index for s in samples] == list(range(6))
    for s in samples:
        assert s.prompt_ids == tok.encode(s.prompt) and 1 <= len(s.response_ids) <= 5
        assert len(s.rollout_logprobs) == len(s.response_ids) and all(lp <= 0 for lp in s.rollout_logprobs)
        full = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = model.lm_head(model(full))[0, len(s.prompt_ids) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=1e-5)  # what the trainer recomputes
    new = Decoder(model.config)
    eng.update_weights(new.state_dict(), version=5)
    assert eng.weight_version == 5
    assert all(s.weight_version == 5 for s in eng.generate(prompts[:1], SamplingParams(max_new_tokens=2), n=2))
