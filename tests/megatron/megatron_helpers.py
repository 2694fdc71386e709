"""Tiny HF models and batches shared by the Megatron tests (built offline from configs)."""

from __future__ import annotations

import torch

from miles_core.train.batch import make_train_batch
from miles_core.types import Sample

VOCAB = 61  # odd on purpose: tensor_parallel=2 then pads the vocab to 62


def hf_config(model_type: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6)
    if model_type == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**common, tie_word_embeddings=True)
    return transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                       norm_topk_prob=True, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])


def hf_model(model_type: str, seed: int = 0):
    """A transformers model with weights large enough (std 0.2) that logprobs are far from uniform."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(model_type)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[model_type]
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def batch(seed: int = 1):
    """Three samples of different prompt/response lengths, one with a loss-mask hole."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    samples = [
        Sample("", ids(5), ids(6), "", [0.0] * 6),
        Sample("", ids(3), ids(2), "", [0.0] * 2),
        Sample("", ids(7), ids(4), "", [0.0] * 4, loss_mask=[1, 0, 1, 1]),
    ]
    b = make_train_batch(samples, pad_id=0)
    b.advantages = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
    return b


def hf_response_logprobs(model, b) -> torch.Tensor:
    """Reference: per response token log_softmax of the transformers model's logits, [N, T]."""
    n, t_max = b.response_mask.shape
    out = torch.zeros(n, t_max)
    for i in range(n):
        p, r = int(b.prompt_lens[i]), int(b.response_lens[i])
        seq = b.input_ids[i, : p + r][None]
        logp = torch.log_softmax(model(seq).logits[0].float(), -1)
        out[i, :r] = logp[p - 1 : p + r - 1].gather(-1, seq[0, p : p + r, None])[:, 0]
    return out * b.response_mask
