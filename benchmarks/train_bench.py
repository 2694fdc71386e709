"""Trainer throughput: tokens/s and MFU on packed sequences, plus the chunked-logprob memory table.

    # the H200 (Qwen3-0.6B shape, packed 4096-token sequences, bf16 with fp32 master weights)
    python benchmarks/train_bench.py --preset qwen3-0.6b --device cuda
    # a tiny CPU smoke run
    python benchmarks/train_bench.py --preset tiny --device cpu --steps 2 --warmup 1
    # another registered trainer backend (the Megatron trainer, once its plugin is installed)
    python benchmarks/train_bench.py --preset qwen3-0.6b --device cuda --backend megatron

One step = one optimizer step (``train_step``) over ``--global-tokens`` tokens made of
``--seq-len``-token samples (each ``--prompt-len`` prompt + response tokens; the loss covers the
responses), cut into micro-batches of ``--micro-batch-tokens`` packed tokens; PPO-clip loss on
random advantages. Model FLOPs per step (MFU counts no recomputation):

    6 * N_matmul * tokens  +  6 * V * H * response_tokens  +  6 * L * heads * head_dim * sum_i s_i^2

``N_matmul`` = weights of the decoder blocks' matmuls; the LM head is counted on the response
tokens it is applied to; the attention term is causal (half of the s x s products), fwd + bwd.
MFU = model FLOPs / time / peak (default 789e12, the measured H200 bf16 matmul rate).
If env OUT is set, results go to $OUT/train_bench.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from logprob_memory import measure, table  # noqa: E402

from miles_core.config.loader import load_config  # noqa: E402
from miles_core.context import RunContext  # noqa: E402
from miles_core.kernels.base import Kernels  # noqa: E402
from miles_core.models.decoder import Decoder, DecoderConfig  # noqa: E402
from miles_core.plugins.manager import MilesPlugins  # noqa: E402
from miles_core.train.batch import make_train_batch  # noqa: E402
from miles_core.types import Sample  # noqa: E402

PRESETS = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                       intermediate_size=3072, qk_norm=True, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=40960),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, qk_norm=True),
}


def model_flops(cfg: DecoderConfig, seq_lens: list[int], response_tokens: int) -> float:
    d, h = cfg.dim_head, cfg.hidden_size
    attn_w = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, o + k, v
    mlp_w = 3 * h * cfg.intermediate_size
    n_matmul = cfg.num_layers * (attn_w + mlp_w)
    tokens = sum(seq_lens)
    attention = 6 * cfg.num_layers * cfg.num_heads * d * sum(s * s for s in seq_lens)
    return 6 * n_matmul * tokens + 6 * cfg.vocab_size * h * response_tokens + attention


def make_batch(n: int, seq_len: int, prompt_len: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(1, vocab, (seq_len,), generator=g).tolist()
        samples.append(Sample("", ids[:prompt_len], ids[prompt_len:], "", [-1.0] * (seq_len - prompt_len), group_id=i, index=i))
    batch = make_train_batch(samples, pad_id=0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    batch.old_logprobs = batch.rollout_logprobs.clone()
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--backend", default="torch", help="a registered trainer (torch; megatron when its plugin is installed)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--global-tokens", type=int, default=65536)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=789.0)
    ap.add_argument("--no-memory-table", action="store_true")
    ap.add_argument("overrides", nargs="*", help="extra config overrides, key=value")
    args = ap.parse_args()
    if args.preset == "tiny" and args.seq_len == 4096:
        args.seq_len, args.prompt_len, args.global_tokens, args.micro_batch_tokens = 256, 16, 1024, 512

    device = torch.device(args.device)
    torch.manual_seed(0)
    dcfg = DecoderConfig(**PRESETS[args.preset])
    model = Decoder(dcfg)
    cfg = load_config(None, [
        f"train.backend={args.backend}", f"train.precision={args.precision}", "rollout.temperature=1.0",
        f"train.max_tokens_per_micro_batch={args.micro_batch_tokens}", f"train.micro_batch_size={10**6}",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}", "train.lr=0.00001", *args.overrides,
    ])
    plugins = MilesPlugins()
    regs = plugins.registries
    platform = "cuda" if device.type == "cuda" else "cpu"
    ctx = RunContext(cfg, plugins, None, device, platform, Kernels(plugins, platform))
    trainer = regs.trainers.get(args.backend, key="--backend")(ctx, model)
    loss_fn = functools.partial(regs.policy_losses.get("ppo_clip", key="loss"), cfg=cfg.algorithm)
    n = max(1, args.global_tokens // args.seq_len)
    batches = [make_batch(n, args.seq_len, args.prompt_len, dcfg.vocab_size, seed) for seed in range(2)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(args.warmup):
        trainer.train_step(batches[i % 2], loss_fn)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):
        m = trainer.train_step(batches[i % 2], loss_fn)
    sync()
    dt = (time.perf_counter() - t0) / args.steps
    # the no-grad logprob pass, warm: its first call compiles a graph of its own under train.compile
    # (timed cold, as until session 7, the column showed mostly compile time: 4.6-8k tok/s vs 52k eager)
    trainer.compute_logprobs(batches[0])
    sync()
    t1 = time.perf_counter()
    for i in range(2):
        trainer.compute_logprobs(batches[i % 2])
    sync()
    dt_fwd = (time.perf_counter() - t1) / 2
    seq_lens = [args.seq_len] * n
    resp = n * (args.seq_len - args.prompt_len)
    flops = model_flops(dcfg, seq_lens, resp)
    tokens = n * args.seq_len
    result = {
        "backend": args.backend, "preset": args.preset, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "precision": args.precision, "seq_len": args.seq_len, "samples_per_step": n,
        "tokens_per_step": tokens, "micro_batch_tokens": args.micro_batch_tokens, "activation_checkpointing": args.activation_checkpointing,
        "step_s": dt, "tokens_per_s": tokens / dt, "model_tflops_per_step": flops / 1e12,
        "mfu": flops / dt / (args.peak_tflops * 1e12), "logprob_pass_tokens_per_s": tokens / dt_fwd,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "params": sum(p.numel() for p in model.parameters()), "last_loss": m["loss"],
    }
    print("| backend | preset | device | tokens/step | step s | tokens/s | MFU | logprob pass tok/s | peak mem GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    mem = f"{result['peak_mem_gib']:.1f}" if result["peak_mem_gib"] is not None else "-"
    print(f"| {args.backend} | {args.preset} | {result['device']} | {tokens} | {dt:.3f} | {result['tokens_per_s']:.0f} | "
          f"{100 * result['mfu']:.1f}% | {result['logprob_pass_tokens_per_s']:.0f} | {mem} |")
    rows = []
    if not args.no_memory_table:
        del trainer
        mem_device = "cuda" if device.type == "cuda" else "meta"
        rows = [measure(16384, 151936, 1024, dt_, mem_device) for dt_ in (torch.bfloat16, torch.float32)]
        print("\nchunked logprobs, peak extra memory (fwd + bwd):")
        print(table(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_bench.json").write_text(json.dumps({"train": result, "logprob_memory": rows}, indent=2))


if __name__ == "__main__":
    main()
