"""DAPO filters and shaping, dynamic sampling in the loop, the PPO critic, SFT data and config errors."""

import json
from types import SimpleNamespace

import pytest
import torch

from miles_core.algorithms.dapo import informative_groups, overlong_penalty
from miles_core.config.loader import load_config
from miles_core.data.sft import read_sft_examples
from miles_core.data.tokenizer import CharTokenizer
from miles_core.errors import ConfigError, DataError
from miles_core.models.decoder import Decoder, DecoderConfig
from miles_core.orchestration.collect import collect
from miles_core.rollout.base import SamplingParams
from miles_core.train.batch import make_train_batch
from miles_core.train.critic import Critic
from miles_core.types import Prompt, Sample


def test_informative_groups():
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5, 1], [0, 0, 1, 1, 2, 2, 3]) == {1}


def test_overlong_penalty_by_hand():
    # L_max = 10, buffer 4: no penalty up to 6 tokens, then linear to -1 at 10
    assert [overlong_penalty(n, 10, 4) for n in (5, 6, 7, 8, 10, 11)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(10, 10, 4, scale=0.5) == -0.5
    assert overlong_penalty(10, 10, 0) == 0.0


class FakeBackend:
    """Stands in for the engine: deterministic "responses" whose correctness is set per prompt."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, n=1):
        self.calls.append(len(prompts))
        out = []
        for gi, p in enumerate(prompts):
            for k in range(n):
                good = p.label == "mixed" and k == 0
                out.append(Sample(p.text, [3], [4] * (k + 1), "ok" if good else "no", [0.0] * (k + 1), p.label, group_id=gi))
        return out


def _components(tmp_path, *overrides):
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
                             "rollout.max_response_len=4", *overrides])
    reward = lambda s: 1.0 if s.response == "ok" else 0.0
    return SimpleNamespace(ctx=SimpleNamespace(config=cfg), reward_fn=reward, reward_name="test")


def _stream(labels):
    it = iter(labels)
    return lambda n: [Prompt(f"p{i}", label=next(it)) for i in range(n)]


def test_dynamic_sampling_drops_uniform_groups_and_refills(tmp_path):
    c = _components(tmp_path, "algorithm.dynamic_sampling=true")
    backend = FakeBackend()
    labels = ["mixed", "same", "same", "same", "mixed", "same", "mixed", "mixed", "mixed"] + ["same"] * 50
    samples, m = collect(c, backend, _stream(labels), SamplingParams())
    assert [s.group_id for s in samples] == [0, 0, 1, 1, 2, 2]
    assert [s.index for s in samples] == list(range(6))
    assert all(s.label == "mixed" for s in samples)
    # round 1 kept 1 of 3 groups -> asks for (3 - 1) / (1/3) = 6 more prompts, which fill the batch
    assert backend.calls == [3, 6]
    assert m["dynamic_sampling_rounds"] == 1.0 and m["dynamic_sampling_kept_groups"] == 3.0
    assert m["dynamic_sampling_generated_groups"] == 9.0


def test_dynamic_sampling_gives_up_after_max_rounds(tmp_path):
    c = _components(tmp_path, "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=2")
    backend = FakeBackend()
    samples, m = collect(c, backend, _stream(["same"] * 200), SamplingParams())
    assert samples == [] and m["dynamic_sampling_kept_groups"] == 0.0
    # nothing kept: the keep rate counts as its floor 1/8, so each extra round asks for 8 times the 3 missing groups
    assert backend.calls == [3, 24, 24]


def test_collect_passes_on_the_backend_s_metrics(tmp_path):
    class Reporting(FakeBackend):
        def pop_metrics(self):
            return {"engine_restarts": 1.0}

    _, m = collect(_components(tmp_path), Reporting(), _stream(["mixed"] * 3), SamplingParams())
    assert m.keys() == {"engine_restarts", "rollout_tok_s"} and m["engine_restarts"] == 1.0
    c = _components(tmp_path, "algorithm.dynamic_sampling=true")
    _, m = collect(c, Reporting(), _stream(["mixed"] * 3), SamplingParams())
    assert m["engine_restarts"] == 1.0 and m["dynamic_sampling_kept_groups"] == 3.0


def test_overlong_shaping_changes_rewards(tmp_path):
    c = _components(tmp_path, "algorithm.overlong_buffer=2")
    samples, _ = collect(c, FakeBackend(), _stream(["mixed"] * 3), SamplingParams())
    # responses of 1 and 2 tokens with L_max 4, buffer 2: no penalty; "ok" stays 1.0
    assert [s.reward for s in samples[:2]] == [1.0, 0.0]
    c = _components(tmp_path, "algorithm.overlong_buffer=3")
    samples, _ = collect(c, FakeBackend(), _stream(["mixed"] * 3), SamplingParams())
    assert [s.reward for s in samples[:2]] == [1.0, -1 / 3]


def _critic_batch():
    samples = [Sample("", [3, 4], [5, 6, 1], "", [0.0] * 3), Sample("", [3], [7, 1], "", [0.0] * 2)]
    return make_train_batch(samples, 0)


def test_critic_values_and_clipped_value_loss(tmp_path):
    cfg = load_config(None, ["algorithm.value_clip=0.2", "train.lr=0.01"])
    torch.manual_seed(0)
    critic = Critic(Decoder(DecoderConfig(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)), cfg, torch.device("cpu"))
    batch = _critic_batch()
    v = critic.compute_values(batch)
    assert v.shape == (2, 3) and torch.equal(v, torch.zeros(2, 3))  # the head starts at zero
    mask = batch.response_mask
    # V = 0, V_old = 0.5, R = 1: unclipped (0-1)^2 = 1 beats clipped (0.3-1)^2 -> 0.5 per token
    batch.values, batch.returns = 0.5 * mask, mask.clone()
    assert critic.train_step(batch)["value_loss"] == pytest.approx(0.5)
    critic = Critic(critic.body, cfg, torch.device("cpu"))
    critic.head.weight.data.zero_()
    # V = 0, V_old = 0.5, R = 0: clipped (0.3)^2 = 0.09 beats 0 -> 0.045 per token, every token clipped
    batch.returns = torch.zeros_like(mask)
    m = critic.train_step(batch)
    assert m["value_loss"] == pytest.approx(0.045) and m["value_clip_frac"] == pytest.approx(1.0)


def test_critic_fits_returns():
    cfg = load_config(None, ["train.lr=0.02", "algorithm.value_clip=10"])
    torch.manual_seed(0)
    critic = Critic(Decoder(DecoderConfig(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)), cfg, torch.device("cpu"))
    batch = _critic_batch()
    batch.returns = torch.tensor([[0.2, 0.5, 1.0], [-1.0, -0.5, 0.0]]) * batch.response_mask
    losses = []
    for _ in range(30):
        batch.values = critic.compute_values(batch)
        losses.append(critic.train_step(batch)["value_loss"])
    assert losses[-1] < 0.1 * losses[0]


def test_sft_jsonl_with_loss_mask_segments(tmp_path):
    f = tmp_path / "sft.jsonl"
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "ab?", "response": [{"text": "x", "train": False}, {"text": "ba"}]}]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    tok = CharTokenizer()
    a, b = read_sft_examples(str(f), "prompt", "response", tok)
    assert a.response_ids == tok.encode("2") + [tok.eos_token_id] and a.loss_mask == [1, 1]
    assert b.response_ids == tok.encode("xba") + [tok.eos_token_id] and b.loss_mask == [0, 1, 1, 1]
    batch = make_train_batch([a, b], tok.pad_token_id)
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [0, 1, 1, 1]]
    f.write_text(json.dumps({"prompt": "x", "answer": "y"}))
    with pytest.raises(DataError, match=r"sft.jsonl:1: missing key 'response' \(set data.response_key\)"):
        read_sft_examples(str(f), "prompt", "response", tok)
    f.write_text(json.dumps({"prompt": "x", "response": [{"text": "y", "train": "no"}]}))
    with pytest.raises(DataError, match=r"'response'\[0\].train must be true or false"):
        read_sft_examples(str(f), "prompt", "response", tok)
    f.write_text(json.dumps({"prompt": "x", "response": []}))
    with pytest.raises(DataError, match=r"sft.jsonl:1: 'response' must be a string or a non-empty list"):
        read_sft_examples(str(f), "prompt", "response", tok)
    f.write_text("\n  \n")
    with pytest.raises(DataError, match="has no examples"):
        read_sft_examples(str(f), "prompt", "response", tok)


@pytest.mark.parametrize(
    "override, key",
    [
        ("algorithm.clip_c=1.0", "algorithm.clip_c"),
        ("algorithm.kl_estimator=k4", "algorithm.kl_estimator"),
        ("algorithm.kl_mode=advantage", "algorithm.kl_mode"),
        ("algorithm.lam=1.5", "algorithm.lam"),
        ("algorithm.mismatch_correction=is", "algorithm.mismatch_correction"),
        ("algorithm.mismatch_level=batch", "algorithm.mismatch_level"),
        ("algorithm.entropy_coef=-1", "algorithm.entropy_coef"),
        ("algorithm.advantage_estimator=distill", "algorithm.teacher_checkpoint"),
        ("algorithm.distill_coef=0.5", "algorithm.teacher_checkpoint"),
        ("run.mode=eval", "run.mode"),
    ],
)
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_overlong_buffer_must_fit_the_response(tmp_path):
    from miles_core.orchestration.checks import check_algorithm

    with pytest.raises(ConfigError, match=r"algorithm\.overlong_buffer \(8\) must be below rollout\.max_response_len \(8\)"):
        check_algorithm(load_config(None, ["algorithm.overlong_buffer=8", "rollout.max_response_len=8"]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_baselines_refuse_one_sample_per_prompt(tmp_path, estimator):
    """A group of one has no baseline: every advantage would be 0 and the run would learn nothing, silently."""
    from miles_core.orchestration.checks import check_algorithm
    from miles_core.plugins.manager import MilesPlugins

    fn = MilesPlugins(autoload=False).registries.advantage_estimators.get(estimator)
    cfg = load_config(None, [f"algorithm.advantage_estimator={estimator}", "rollout.n_samples_per_prompt=1"])
    with pytest.raises(ConfigError, match=rf"advantage_estimator={estimator} .* rollout\.n_samples_per_prompt >= 2, got 1"):
        check_algorithm(cfg, fn)
    check_algorithm(load_config(None, [f"algorithm.advantage_estimator={estimator}", "rollout.n_samples_per_prompt=2"]), fn)
    greedy = [f"algorithm.advantage_estimator={estimator}", "rollout.n_samples_per_prompt=4", "rollout.temperature=0"]
    with pytest.raises(ConfigError, match=rf"advantage_estimator={estimator} .* rollout\.temperature=0 makes them identical"):
        check_algorithm(load_config(None, greedy), fn)  # the same sample 4 times: every advantage 0
    check_algorithm(load_config(None, [*greedy, "run.mode=sft"]), fn)  # SFT samples nothing
    for other in ("reinforce_plus_plus", "ppo"):  # a batch-wide baseline or a critic: one sample is fine
        check_algorithm(load_config(None, [f"algorithm.advantage_estimator={other}", "rollout.n_samples_per_prompt=1"]),
                        MilesPlugins(autoload=False).registries.advantage_estimators.get(other))
    with pytest.raises(ConfigError, match=r"algorithm\.dynamic_sampling .* rollout\.n_samples_per_prompt >= 2, got 1"):
        check_algorithm(load_config(None, ["algorithm.advantage_estimator=ppo", "algorithm.dynamic_sampling=true",
                                           "rollout.n_samples_per_prompt=1"]))


def test_critic_reads_the_state_before_each_token_and_micro_batches_exactly():
    batch = _critic_batch()
    batch.returns = torch.tensor([[0.2, 0.5, 1.0], [-1.0, -0.5, 0.0]]) * batch.response_mask
    results = []
    for mbs in (64, 1):
        cfg = load_config(None, ["train.lr=0.01", "algorithm.critic_lr=0.003", "algorithm.value_clip=0.1", f"train.micro_batch_size={mbs}"])
        torch.manual_seed(0)
        critic = Critic(Decoder(DecoderConfig(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)), cfg, torch.device("cpu"))
        assert critic.optimizer.param_groups[0]["lr"] == 0.003
        torch.nn.init.normal_(critic.head.weight)
        v = critic.compute_values(batch)
        with torch.no_grad():  # V(s_t): the hidden state at prompt_len - 1 + t, the one that predicts token t
            for i in range(batch.num_samples):
                p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
                h = critic.body(batch.input_ids[i : i + 1, : p + r])[0]
                assert torch.allclose(v[i, :r], critic.head(h[p - 1 : p + r - 1]).squeeze(-1) * batch.response_mask[i, :r], atol=1e-6)
        batch.values = v + 0.3 * batch.response_mask
        m = critic.train_step(batch)
        results.append((m, [p.grad.clone() for p in critic.head.parameters()]))
    (m1, g1), (m2, g2) = results
    assert m1["value_loss"] == pytest.approx(m2["value_loss"], rel=1e-5)  # the mean over all tokens, not per micro-batch
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(g1, g2))


@pytest.mark.parametrize("grad_clip", [0.01, 0.0])
def test_critic_clips_its_gradient_to_train_grad_clip(grad_clip):
    batch = _critic_batch()
    batch.returns = torch.tensor([[0.2, 0.5, 1.0], [-1.0, -0.5, 0.0]]) * batch.response_mask
    batch.values = torch.zeros_like(batch.returns)
    cfg = load_config(None, ["train.lr=0.01", f"train.grad_clip={grad_clip}"])
    torch.manual_seed(0)
    critic = Critic(Decoder(DecoderConfig(vocab_size=12, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)), cfg, torch.device("cpu"))
    m = critic.train_step(batch)
    grads = [p.grad for p in list(critic.body.parameters()) + list(critic.head.parameters()) if p.grad is not None]
    after = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    assert m["value_grad_norm"] > 0.1  # the norm before clipping, reported as it was
    if grad_clip:
        assert after == pytest.approx(grad_clip, rel=1e-4)  # the step took the clipped gradient
    else:  # 0 disables clipping
        assert after == pytest.approx(m["value_grad_norm"], rel=1e-5)


def test_async_schedule_refuses_dynamic_sampling_when_built(tmp_path):
    """Refused by the schedule when the loop made it, this came after the SFT warm-up and the first eval, and
    `miles validate` passed the config."""
    from miles_core.orchestration.build import build
    from miles_core.plugins.manager import MilesPlugins
    from miles_core.testing.contracts import tiny_config

    cfg = tiny_config(tmp_path, "orchestration.schedule=async", "algorithm.dynamic_sampling=true")
    with pytest.raises(ConfigError, match=r"^orchestration.schedule=async does not support algorithm.dynamic_sampling yet$"):
        build(cfg, MilesPlugins(autoload=False), None)
