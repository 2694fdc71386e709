"""The built-in engine: KV-cached generation agrees with a full forward pass of the same model."""

import torch

from miles_core.data.tokenizer import CharTokenizer
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine import BuiltinEngine
from miles_core.types import Prompt


def _engine(seed=0):
    torch.manual_seed(seed)
    tok = CharTokenizer()
    model = Decoder(DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64))
    return BuiltinEngine(model, tok, torch.device("cpu")), tok


def _full_forward_logprobs(model, ids):
    x = torch.tensor([ids])
    logits = model.lm_head(model(x))[0].float()
    return torch.log_softmax(logits, -1)


def test_greedy_matches_full_forward_and_logprobs_agree():
    engine, tok = _engine()
    prompts = [Prompt("ab?"), Prompt("abcde?"), Prompt("c?")]  # uneven lengths: left padding is exercised
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))
    for s in samples:
        seq = s.prompt_ids + s.response_ids
        logp = _full_forward_logprobs(engine.model, seq)
        for t, token in enumerate(s.response_ids):
            pos = len(s.prompt_ids) + t - 1
            assert token == int(logp[pos].argmax()), "greedy token differs from the full forward's argmax"
            assert abs(s.rollout_logprobs[t] - float(logp[pos, token])) < 1e-5


def test_sampled_logprobs_match_temperature_scaled_forward():
    engine, tok = _engine(1)
    samples = engine.generate([Prompt("abc?"), Prompt("a?")], SamplingParams(max_new_tokens=5, temperature=0.7, seed=3), n=3)
    assert [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1]
    for s in samples:
        x = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(engine.model.lm_head(engine.model(x))[0].float() / 0.7, -1)
        for t, token in enumerate(s.response_ids):
            assert abs(s.rollout_logprobs[t] - float(logp[len(s.prompt_ids) + t - 1, token])) < 1e-5


def test_seed_reproducible_and_stop_and_length():
    engine, tok = _engine(2)
    p = SamplingParams(max_new_tokens=4, temperature=1.0, seed=11)
    a = [s.response_ids for s in engine.generate([Prompt("ab?")], p, n=4)]
    b = [s.response_ids for s in engine.generate([Prompt("ab?")], p, n=4)]
    assert a == b
    for s in engine.generate([Prompt("ab?")], p, n=4):
        assert len(s.response_ids) <= 4
        assert (s.finish_reason == "stop") == (s.response_ids[-1] == tok.eos_token_id)


def test_stop_token_ids_end_generation():
    engine, tok = _engine(3)
    greedy = engine.generate([Prompt("ab?")], SamplingParams(max_new_tokens=6, temperature=0.0))[0]
    first = greedy.response_ids[0]
    stopped = engine.generate([Prompt("ab?")], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=[first]))[0]
    assert stopped.response_ids == [first] and stopped.finish_reason == "stop"


def test_update_weights_sets_version_and_changes_output():
    engine, tok = _engine(4)
    before = engine.generate([Prompt("abc?")], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    new = {k: torch.randn_like(v) * 0.5 for k, v in engine.model.state_dict().items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as in the trainer's state dict
    engine.update_weights(new, 7)
    after = engine.generate([Prompt("abc?")], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    assert after.weight_version == 7 and before.weight_version == 0
    assert torch.equal(engine.model.model.embed_tokens.weight, new["model.embed_tokens.weight"])
    # what it generates now is what a fresh engine built on the new weights generates, and not the old output
    fresh, _ = _engine(5)
    fresh.model.load_state_dict(new)
    expected = fresh.generate([Prompt("abc?")], SamplingParams(max_new_tokens=5, temperature=0.0))[0]
    assert after.response_ids == expected.response_ids and after.rollout_logprobs == expected.rollout_logprobs
    assert (after.response_ids, after.rollout_logprobs) != (before.response_ids, before.rollout_logprobs)
