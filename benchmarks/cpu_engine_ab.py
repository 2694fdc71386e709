"""In-process A/B of the CPU engine's knobs: one model, one EngineCore per variant, the variants alternated round by
round (a shared machine's load moves every figure run to run; side by side in one process it moves them together).

A variant is a set of ``cpu_layers`` constants, set before each of its runs:

    panels     PACK_WEIGHT_BYTES = 2 GiB: the C GEMMs read the weights' panel copies (the default)
    wt         PACK_WEIGHT_BYTES = 0: they read W^T
    c-head     LOGITS_ROWS = 64: the lm_head's logits through the C kernel up to 64 rows (the default)
    mkl-head   LOGITS_ROWS = 0: through torch.mm
    rowsN      GEMM_ROWS = N: the C GEMMs (and the one-call decode step) up to N rows (default 256)

Variants combine with "+", e.g. ``wt+mkl-head+rows128`` (the session-21 engine on a model past the window path's 8 MiB).
Prints tok/s (best of ``--rounds``, generated tokens over wall time, prefill included), the ratio to the first variant
per round, and whether every variant drew the same tokens::

    python benchmarks/cpu_engine_ab.py --preset smollm2 --batches 1,8,32 --variants panels,wt
    python benchmarks/cpu_engine_ab.py --preset cpu --batches 64 --variants panels,wt --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rollout_bench as rb  # noqa: E402

from miles_core.rollout.engine_core import cpu_layers  # noqa: E402

KNOBS = {"panels": ("PACK_WEIGHT_BYTES", 2 << 30), "wt": ("PACK_WEIGHT_BYTES", 0), "c-head": ("LOGITS_ROWS", 64),
         "mkl-head": ("LOGITS_ROWS", 0)}


def settings(variant: str) -> dict:
    """The cpu_layers constants of a variant ("panels+mkl-head+rows128"), over the defaults."""
    out = {"PACK_WEIGHT_BYTES": 2 << 30, "LOGITS_ROWS": 64, "GEMM_ROWS": 256}
    for part in variant.split("+"):
        if part.startswith("rows") and part[4:].isdigit():
            out["GEMM_ROWS"] = int(part[4:])
        elif part in KNOBS:
            out[KNOBS[part][0]] = KNOBS[part][1]
        else:
            raise SystemExit(f"unknown variant part {part!r} (know: {', '.join(KNOBS)}, rowsN)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("cpu", "smollm2"), default="smollm2", help="rollout_bench.py's model and shape")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--variants", default="panels,wt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=None, help="default: the preset's")
    args = ap.parse_args()
    a = argparse.Namespace(**rb.PRESETS[args.preset])
    new = args.new_tokens or a.new_tokens
    variants = {v: settings(v) for v in args.variants.split(",")}
    model = rb.cpu_model(args.preset)
    print(f"CPU engine A/B — {args.preset} preset, {torch.get_num_threads()} threads, prompt {a.prompt_len}, new {new}, greedy, "
          f"best of {args.rounds} alternated rounds")
    for bs in map(int, args.batches.split(",")):
        prompts = torch.randint(1, a.vocab, (bs, a.prompt_len), generator=torch.Generator().manual_seed(1)).tolist()
        # KV for this batch only (the CPU default, 65,536 tokens, is 3 GB per engine at SmolLM2's shape)
        cfg = rb.EngineConfig(max_num_seqs=bs, max_model_len=a.prompt_len + new + 16, max_batched_tokens=16384,
                              kv_tokens_cpu=bs * (a.prompt_len + new + 16))
        cores = {v: rb.EngineCore(model, cfg) for v in variants}
        best, outs, ratios = {}, {}, []
        for _ in range(args.rounds):
            took = {}
            for v, core in cores.items():
                for name, value in variants[v].items():
                    setattr(cpu_layers, name, value)
                took[v], outs[v] = rb.bench_engine(core, prompts, new, torch.device("cpu"))
                best[v] = min(best.get(v, float("inf")), took[v])
            ratios.append([took[next(iter(cores))] / t for t in took.values()])
        same = all(out == outs[next(iter(outs))] for out in outs.values())
        cells = "  ".join(f"{v} {bs * new / t:9.1f} tok/s (x{', '.join(f'{r[i]:.2f}' for r in ratios)})"
                          for i, (v, t) in enumerate(best.items()))
        print(f"batch {bs:4d}: {cells}  same tokens: {same}", flush=True)
        del cores
        gc.collect()  # the engines' caches go before the next batch's (an engine holds reference cycles)
    for name, value in settings("panels").items():  # back to the defaults
        setattr(cpu_layers, name, value)


if __name__ == "__main__":
    main()
