"""Peak extra memory of the chunked "logprobs" op vs. a plain log_softmax over [tokens, vocab].

CPU (no memory is allocated): tensors live on the ``meta`` device and a dispatch mode counts the
bytes of every storage an op creates until it is freed ("tracemalloc for tensors"), through
forward and backward. Extra memory = peak live bytes created after the inputs (hidden states and
LM head) exist; it includes the gradients of the inputs. On CUDA, ``--device cuda`` measures
``torch.cuda.max_memory_allocated`` minus the memory allocated before the call.

    python benchmarks/logprob_memory.py                    # meta accounting, vocab 151936, 16k tokens
    python benchmarks/logprob_memory.py --device cuda      # the same shapes, real memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from miles_core.kernels.logprobs import logprobs_naive, logprobs_torch  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages created by ops while active; ``peak`` is the high-water mark."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak = 0

    def _sweep(self) -> None:
        for key, (ref, size) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    size = storage.nbytes()
                    self.live[key] = (StorageWeakRef(storage), size)
                    self.current += size
        self.peak = max(self.peak, self.current)
        return out


def _fwd_bwd(fn, hidden, weight, targets) -> None:
    logp, ent = fn(hidden, weight, targets)
    (logp.sum() + 0.1 * ent.sum()).backward()


def measure(tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype, device: str = "meta", chunk_size: int = 1024) -> dict:
    results = {}
    fns = {"naive": lambda h, w, y: logprobs_naive(h, w, y), "chunked": lambda h, w, y: logprobs_torch(h, w, y, chunk_size=chunk_size)}
    for name, fn in fns.items():
        hidden = torch.randn(tokens, hidden_size, dtype=dtype, device=device, requires_grad=True)
        weight = torch.randn(vocab, hidden_size, dtype=dtype, device=device, requires_grad=True)
        targets = torch.randint(0, vocab, (tokens,), device=device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            _fwd_bwd(fn, hidden, weight, targets)
            torch.cuda.synchronize()
            results[name] = torch.cuda.max_memory_allocated() - base
        else:
            mode = LiveBytes()
            with mode:
                _fwd_bwd(fn, hidden, weight, targets)
            results[name] = mode.peak
        del hidden, weight, targets
    return {"tokens": tokens, "vocab": vocab, "hidden": hidden_size, "dtype": str(dtype).replace("torch.", ""),
            "chunk_size": chunk_size, "device": device, "naive_bytes": results["naive"], "chunked_bytes": results["chunked"],
            "ratio": results["chunked"] / results["naive"]}


def table(rows: list[dict]) -> str:
    lines = ["| tokens | vocab | hidden | dtype | chunk | naive peak extra | chunked peak extra | ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['vocab']} | {r['hidden']} | {r['dtype']} | {r['chunk_size']} | "
                     f"{r['naive_bytes'] / 2**30:.2f} GiB | {r['chunked_bytes'] / 2**30:.2f} GiB | {100 * r['ratio']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="meta")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--chunk-size", type=int, default=1024)
    args = ap.parse_args()
    rows = [measure(args.tokens, args.vocab, args.hidden, dt, args.device, args.chunk_size) for dt in (torch.bfloat16, torch.float32)]
    print(table(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "logprob_memory.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
