"""The CPU decode window's fused C kernels (cpu_native.c): each kernel against the torch ops it replaces,
the engine with them against the engine without them and against transformers, and the build: cached,
and a clear error (engine.cpu_kernels='native') or the torch ops (the default 'auto') without a C compiler.

The kernels are built with the machine's C compiler (CI has gcc); where none is found the kernel tests skip
and say so."""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import load_miles, make_hf_model, tiny

from miles_core.errors import ConfigError
from miles_core.kernels.rmsnorm import rmsnorm_torch
from miles_core.kernels.rope import rope_torch
from miles_core.rollout.base import SamplingParams
from miles_core.rollout.engine_core import cpu_layers, cpu_native
from miles_core.rollout.engine_core.attention import AttnBatch, paged_attention
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.core import EngineCore
from miles_core.rollout.engine_core.sampler import SamplingTensors, sample_torch
from miles_core.rollout.engine_core.cpu_native import NativeBuildError, NativeKernels


@pytest.fixture(scope="module")
def nat(tmp_path_factory):
    if not any(cpu_native.shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler to build cpu_native.c")
    return NativeKernels(cpu_native.build(tmp_path_factory.mktemp("native")))  # with a compiler, it must build


def reference_step(qkv, cos, sin, q_w, k_w, eps, kt, v, mask, heads, col, scale):
    """What the torch path of cpu_decode.window computes for one layer and step (norms, rotary, the column
    write, baddbmm + softmax + bmm); returns (out, kt, v) with the column written into copies."""
    b, hk, d, cap = kt.shape
    q = qkv[:, : heads * d].reshape(b, heads, 1, d)
    k = qkv[:, heads * d : (heads + hk) * d].reshape(b, hk, 1, d)
    if q_w is not None:
        q, k = rmsnorm_torch(q, q_w, eps), rmsnorm_torch(k, k_w, eps)
    c, s = cos[:, None, None], sin[:, None, None]
    q, k = rope_torch(q, c, s), rope_torch(k, c, s)
    kt, v = kt.clone(), v.clone()
    kt[..., col] = k.view(b, hk, d)
    v[:, :, col] = qkv[:, (heads + hk) * d :].view(b, hk, d)
    scores = torch.baddbmm(mask[:, None, : col + 1], q.reshape(b * hk, heads // hk, d), kt.view(b * hk, d, cap)[..., : col + 1], alpha=scale)
    out = torch.bmm(torch.softmax(scores, -1), v.view(b * hk, cap, d)[:, : col + 1]).reshape(b, heads * d)
    return out, kt, v


def blocks(kt: torch.Tensor) -> torch.Tensor:
    """K^T [B, Hk, D, cap] -> the kernels' layout [B, Hk, cap / 16, D, 16]."""
    b, hk, d, cap = kt.shape
    return kt.view(b, hk, d, cap // 16, 16).permute(0, 1, 3, 2, 4).contiguous()


@pytest.mark.parametrize("b,heads,kv_heads,d,cap,col,qk_norm", [
    (1, 4, 2, 32, 48, 0, False),  # the first column only
    (3, 4, 2, 32, 48, 17, False),  # a partial last block of 16 columns
    (5, 16, 8, 128, 304, 255, True),  # Qwen3-0.6B's heads, q/k norm
    (2, 32, 4, 64, 112, 63, False),  # 8 query heads per KV head
    (4, 12, 1, 32, 64, 31, False),  # 12 per KV head: two row chunks of the score pass, three of the PV pass
    (64, 4, 2, 32, 400, 300, False),  # the quickstart model at batch 64 (the rows run on OpenMP threads)
    (2, 6, 2, 16, 32, 19, True),
])
def test_attention_step_matches_the_torch_ops(nat, b, heads, kv_heads, d, cap, col, qk_norm):
    g = torch.Generator().manual_seed(col)
    qkv = torch.randn(b, (heads + 2 * kv_heads) * d + 3, generator=g)[:, 3:]  # rows strided, as a view may be
    pos = torch.randint(0, 4000, (b,), generator=g).float()
    ang = pos[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos(), ang.sin()
    kt, v = torch.randn(b, kv_heads, d, cap, generator=g), torch.randn(b, kv_heads, cap, d, generator=g)
    mask = torch.zeros(b * kv_heads, cap)
    mask[::2, : col // 2] = float("-inf")  # every other row starts later (left out of its context)
    q_w = torch.rand(d, generator=g) + 0.5 if qk_norm else None
    k_w = torch.rand(d, generator=g) + 0.5 if qk_norm else None
    ref, kt_ref, v_ref = reference_step(qkv, cos, sin, q_w, k_w, 1e-6, kt, v, mask, heads, col, d**-0.5)
    out = torch.full((b, heads * d), float("nan"))
    kb = blocks(kt)
    nat.attn_step(qkv, cos, sin, q_w, k_w, 1e-6, kb, v, mask, out, heads, col, d**-0.5)
    assert torch.equal(v, v_ref)  # the V column is a copy
    if qk_norm:  # the norm's sum runs in another order: rounding
        assert torch.allclose(kb, blocks(kt_ref), atol=2e-6, rtol=0)
    else:  # the rotary is rope_torch's arithmetic, operation for operation
        assert torch.equal(kb, blocks(kt_ref))
    assert torch.allclose(out, ref, atol=2e-6, rtol=0)


def test_rmsnorm_and_silu_mul_match_the_torch_ops(nat):
    g = torch.Generator().manual_seed(0)
    for rows, n in ((1, 32), (37, 128), (600, 1024)):  # 600 x 1024: OpenMP threads
        x = (torch.randn(rows, n + 5, generator=g) * torch.rand(rows, 1, generator=g) * 20)[:, :n]  # strided rows
        w = torch.randn(n, generator=g)
        out = nat.rmsnorm(x, w, 1e-6, torch.empty(rows, n))
        assert torch.allclose(out, rmsnorm_torch(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    for rows, inter in ((1, 16), (33, 100), (300, 512)):  # 100: a tail past the last 16
        gu = torch.randn(rows, 2 * inter, generator=g) * 10
        gu[0, :4] = torch.tensor([-200.0, 200.0, -88.5, 0.0])  # exp's clamps
        out = nat.silu_mul(gu, torch.empty(rows, inter))
        ref = F.silu(gu[:, :inter]) * gu[:, inter:]
        assert torch.isfinite(out).all()
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,d,qk_norm,chunks", [
    (4, 2, 32, False, ((7, 7), (1, 1), (16, 16))),  # fresh prompts (ctx == q_len), one of a single token
    (16, 8, 128, True, ((5, 13), (9, 9))),  # Qwen3-0.6B's heads, q/k norm; a chunk after 8 cached tokens
    (12, 1, 32, False, ((3, 40), (20, 33), (1, 2))),  # 12 query heads per KV head; chunks with context
    (4, 2, 32, False, tuple((128, 128) for _ in range(8))),  # quickstart rows, on OpenMP threads
])
def test_prefill_kernels_match_the_paged_attention(nat, heads, kv_heads, d, qk_norm, chunks):
    """prefill_rope + prefill_attn against rope_torch / rmsnorm_torch and attention.paged_attention (the torch
    prefill): chunks (q_len, ctx) on scattered pages of 4 slots, the context before each chunk already cached."""
    g = torch.Generator().manual_seed(d + len(chunks))
    p, b = 4, len(chunks)
    q_lens, ctx = [q for q, _ in chunks], [c for _, c in chunks]
    width = max(-(-c // p) for c in ctx)
    pages = torch.randperm(b * width + 3, generator=g)[: b * width].view(b, width) + 1  # page 0 unused
    slots_total = (b * width + 4) * p
    kc, vc = torch.randn(slots_total, kv_heads, d, generator=g), torch.randn(slots_total, kv_heads, d, generator=g)
    pos = torch.cat([torch.arange(c - q, c) for q, c in chunks])
    rows = torch.cat([torch.full((q,), i) for i, (q, _) in enumerate(chunks)])
    slots = pages[rows, pos // p] * p + pos % p
    n = pos.shape[0]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d + 5, generator=g)[:, 5:]  # rows strided
    ang = torch.arange(max(ctx))[:, None].float() / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([ang, ang], -1)
    cos_t, sin_t = ang.cos()[:, None], ang.sin()[:, None]  # [P, 1, D], as the decoder's tables
    q_w = torch.rand(d, generator=g) + 0.5 if qk_norm else None
    k_w = torch.rand(d, generator=g) + 0.5 if qk_norm else None
    # the torch prefill: norms and rotary, the cache written at the slots, SDPA over the gathered pages
    q = qkv[:, : heads * d].reshape(n, heads, 1, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].reshape(n, kv_heads, 1, d)
    if qk_norm:
        q, k = rmsnorm_torch(q, q_w, 1e-6), rmsnorm_torch(k, k_w, 1e-6)
    c, s = cos_t[pos][:, None], sin_t[pos][:, None]
    q, k = rope_torch(q, c, s).squeeze(2), rope_torch(k, c, s).squeeze(2)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref[slots], vc_ref[slots] = k, qkv[:, (heads + kv_heads) * d :].reshape(n, kv_heads, d)
    qmax = max(q_lens)
    meta = AttnBatch(pages, torch.tensor(ctx), torch.cat([torch.arange(q) + i * qmax for i, q in enumerate(q_lens)]),
                     torch.tensor([[c - q + i if i < q else -1 for i in range(qmax)] for q, c in chunks]), b, qmax, width * p)
    ref = paged_attention(q, kc_ref, vc_ref, meta, p).reshape(n, heads * d)

    qkv_in = qkv.clone()
    nat.prefill_rope(qkv, pos, cos_t, sin_t, q_w, k_w, 1e-6, kc, vc, slots, heads)
    exact = not qk_norm  # the rotary is rope_torch's arithmetic; the norms sum in another order
    close = (lambda a, b: torch.equal(a, b)) if exact else (lambda a, b: torch.allclose(a, b, atol=2e-6, rtol=0))
    assert close(kc, kc_ref) and torch.equal(vc, vc_ref)  # every other slot untouched
    assert close(qkv[:, : heads * d].reshape(n, heads, d), q)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], qkv_in[:, (heads + kv_heads) * d :])
    q_len = torch.tensor(q_lens)
    out = torch.full((n, heads * d), float("nan"))
    nat.prefill_attn(qkv, kc, vc, pages, p, q_len.cumsum(0) - q_len, q_len, torch.tensor(ctx), out, heads, width * p, d**-0.5)
    assert torch.allclose(out, ref, atol=2e-6, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_engine_with_the_kernels_matches_the_engine_without(nat, family, tmp_path, monkeypatch):
    make_hf_model(family, tmp_path, head_dim=16)
    model = load_miles(tmp_path)
    prompts = [[5, 17, 3, 44, 9, 21, 60, 2, 11], [7, 70, 33], list(range(1, 30))]
    params = [SamplingParams(max_new_tokens=14, temperature=0), SamplingParams(max_new_tokens=20, temperature=0.9, seed=4),
              SamplingParams(max_new_tokens=9, temperature=1.0, top_k=8, seed=2, top_logprobs=2)]
    results = {}
    monkeypatch.setattr(cpu_layers, "PREFILL_ROWS", 5)  # prefills in pieces of 5 rows: chunks cut between pieces
    for kernels in ("native", "torch"):
        # 16 prompt tokens per step: the 29-token prompt is prefilled in two chunks, the second after 16 cached tokens
        core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, max_batched_tokens=16, cpu_kernels=kernels))
        prefills = []
        if kernels == "native":  # count the prefill kernel's calls: the prefill, too, runs through the kernels
            attn = core._cpu._native.prefill_attn
            core._cpu._native.prefill_attn = lambda *a, **k: prefills.append(list(zip(a[6].tolist(), a[7].tolist()))) or attn(*a, **k)
        reqs = [core.add_request(p, sp)[0] for p, sp in zip(prompts, params)]
        reqs += core.add_request(prompts[0], params[1], n=2)  # two samples sharing their prompt's pages
        while core.has_unfinished():
            core.step()
        assert (core._cpu._native is not None) == (kernels == "native")
        if kernels == "native":
            chunks = [c for step in prefills for c in step]  # (q_len, ctx) of each chunk, per layer
            assert any(ctx > q for q, ctx in chunks), prefills  # chunks (and pieces) after cached context
        results[kernels] = reqs
    for a, b in zip(results["native"], results["torch"]):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        if family == "qwen3_moe":
            assert torch.equal(torch.cat(a.routed_experts), torch.cat(b.routed_experts))


def test_build_is_cached_and_fails_clearly_without_a_compiler(tmp_path, monkeypatch, caplog):
    if not any(cpu_native.shutil.which(c) for c in ("cc", "gcc", "clang")):
        pytest.skip("no C compiler")
    first = cpu_native.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind
    blocked = tmp_path / "file"  # a cache "folder" that cannot be made: the temporary folder serves
    blocked.write_text("")
    monkeypatch.setattr(cpu_native.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert cpu_native.build(blocked / "native").parent.parent == tmp_path / "tmp"
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(NativeBuildError, match="no C compiler found"):
        cpu_native.build(tmp_path)
    with pytest.raises(NativeBuildError, match="cpu_kernels='native'"):
        NativeKernels.load("native")
    with pytest.raises(NativeBuildError, match="no C compiler found"):  # at start-up, not at the first decode
        EngineCore(tiny(), EngineConfig(cpu_kernels="native"))
    core = EngineCore(tiny(seed=1, head_dim=16), EngineConfig(block_size=4))  # auto: falls back to the torch ops
    (req,) = core.add_request([3, 9, 27], SamplingParams(max_new_tokens=6, temperature=0))
    while core.has_unfinished():
        core.step()
    assert core._cpu._native is None and len(req.output_ids) == 6
    with caplog.at_level(logging.WARNING):
        assert NativeKernels.load("auto") is None
    assert "cpu_kernels='torch'" in caplog.text
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails: the error carries the command
    with pytest.raises(NativeBuildError, match="exited 1"):
        cpu_native.build(tmp_path / "other")


def test_cpu_kernels_setting_is_validated():
    with pytest.raises(ConfigError, match="cpu_kernels"):
        EngineConfig(cpu_kernels="fast").validate()


@pytest.mark.parametrize("b,vocab,sampled", [(5, 53, True), (64, 53, False), (7, 1000, True), (300, 2000, True)])
def test_sampler_matches_sample_torch(nat, b, vocab, sampled):
    """The C sampler against sampler.sample_torch: the same tokens (greedy rows and seeded draws from the same
    counter-based uniforms) and log-softmax values within rounding."""
    g = torch.Generator().manual_seed(vocab + b)
    logits = (torch.randn(b, vocab + 3, generator=g) * 2)[:, :vocab]  # rows strided
    params = [SamplingParams(temperature=(0.0 if i % 3 == 0 or not sampled else 0.5 + i % 4 * 0.3)) for i in range(b)]
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=g).tolist()
    st = SamplingTensors.build(params, seeds, "cpu")
    counters = torch.randint(0, 5000, (b,), generator=g)
    for j in (0, 3):
        ref_tok, ref_lp, _ = sample_torch(logits, st, counters + j)
        tok, lp = nat.sample(logits, st.temperature, st.seeds, counters, j)
        assert torch.equal(tok, ref_tok)
        assert torch.allclose(lp, ref_lp, atol=2e-6, rtol=1e-6)
    if sampled:  # the draws differ from the greedy choice somewhere (the test sees real sampling)
        assert not torch.equal(tok, logits.argmax(-1))


@pytest.mark.parametrize("m,k,n", [(1, 32, 32), (7, 128, 80), (5, 64, 96), (64, 128, 768), (13, 384, 144), (130, 64, 256)])
def test_gemm_matches_torch(nat, m, k, n):
    """The decode GEMM (6-row tiles, 64-column groups: row and column tails here) against torch.mm: plain, with the
    residual added in place, and with SwiGLU in the epilogue (gate = the first n / 2 columns); the weights as W^T and
    in panels (NativeKernels.pack, a last panel part zeros here for n = 80, 144 and SwiGLU's 48 columns) give the same
    bits."""
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k + 3, generator=g)[:, :k]  # rows strided
    wt = torch.randn(n, k, generator=g).t().contiguous() / k**0.5
    ref = torch.mm(x, wt)
    panels = nat.pack(wt)
    assert panels.shape == cpu_native.panels_shape(k, n, False) == (-(-n // 64), k, 64)
    out = nat.gemm(x, wt, torch.full((m, n), float("nan")))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(nat.gemm(x, panels, torch.full((m, n), float("nan"))), out)
    res = torch.randn(m, n, generator=g)
    expect = res + ref
    out = nat.gemm(x, wt, res.clone(), add=res)
    assert torch.allclose(out, expect, atol=1e-5, rtol=1e-5)
    assert torch.equal(nat.gemm(x, panels, res, add=res), out)  # the residual added in place
    if n % 32 == 0:
        gate, up = ref.chunk(2, -1)
        out = nat.gemm(x, wt, torch.full((m, n // 2), float("nan")), swiglu=True)
        assert torch.allclose(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
        assert torch.equal(nat.gemm(x, nat.pack(wt, swiglu=True), torch.full((m, n // 2), float("nan")), swiglu=True), out)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_whole_step_equals_the_per_call_layers(nat, family, tmp_path):
    """miles_decode_step (all layers in one call) runs the per-call path's kernels in the same order: the same bits
    for the hidden states and the window buffer's new K/V column."""
    make_hf_model(family, tmp_path, head_dim=16)
    core = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, cpu_kernels="native"))
    dec, run = core._cpu, core.runner
    *_, nplan = dec._window_statics()
    assert nplan is not None and cpu_layers.gemm_ok(nplan, 5)
    g = torch.Generator().manual_seed(3)
    b, hk, d, cap, col = 5, run.kv_heads, run.head_dim, 32, 9
    heads = run.model.config.num_heads
    hidden = run.model.config.hidden_size
    x0 = torch.randn(b, hidden, generator=g)
    cos, sin = torch.randn(12, d, generator=g), torch.randn(12, d, generator=g)  # tables: row pos + 2 is row b's
    pos = torch.tensor([7, 0, 3, 9, 4])
    slot = torch.tensor([2, 0, 4, 1, 3])  # row b's K/V and mask in buffer row slot[b]
    keys = torch.randn(run.num_layers, b, hk, cap // 16, d, 16, generator=g)
    values = torch.randn(run.num_layers, b, hk, cap, d, generator=g)
    mask = torch.zeros(b * hk, cap)
    mask[1::2, :3] = float("-inf")
    outs = []
    for whole in (True, False):
        k_l, v_l = keys.clone().unbind(0), values.clone().unbind(0)
        bufs, o_buf, x = cpu_layers.buffers(nplan, b, hidden), torch.empty(b, heads * d), x0.clone()
        if whole:
            tok, embed = torch.arange(b), x0.clone()  # the embedding table: x0's rows
            fn = dec._window_statics()[2]
            xn = nat.decode_step(tok, embed, x, *cpu_layers.step_args(nplan, k_l, v_l), fn[1:], torch.empty(b, hidden), cos,
                                 sin, pos, 2, slot, mask, col, d**-0.5, bufs, o_buf, heads, hk)
            assert torch.equal(xn, nat.rmsnorm(x, fn[1], fn[2], torch.empty(b, hidden)))
        else:
            def attend(i, qkv, q_w, k_w, eps):
                return nat.attn_step(qkv, cos[pos + 2], sin[pos + 2], q_w, k_w, eps, k_l[i], v_l[i], mask, o_buf, heads, col,
                                     d**-0.5, slot=slot)

            x = cpu_layers.native_layers(nat, nplan, x, attend, bufs, run, [], True)
        outs.append((x, torch.stack(k_l), torch.stack(v_l)))
    for a, b_ in zip(*outs):
        assert torch.equal(a, b_)
    assert not torch.equal(outs[0][0], x0) and not torch.equal(outs[0][1], keys)  # the step did run


@pytest.mark.parametrize("m,hidden,vocab", [(1, 32, 53), (13, 40, 1001), (64, 128, 53), (5, 576, 300)])
def test_logits_match_torch(nat, m, hidden, vocab):
    """The lm_head's logits (tiles of 4 rows x 6 vocabulary rows; row, vocabulary and hidden tails here) against
    torch.mm; and a row's logits are the same bits alone as in the batch (the engine's step-by-step and one-call
    windows rely on it)."""
    g = torch.Generator().manual_seed(m + vocab)
    x, head = torch.randn(m, hidden, generator=g), torch.randn(vocab, hidden, generator=g) / hidden**0.5
    out = nat.logits(x, head, torch.full((m, vocab), float("nan")))
    assert torch.allclose(out, x @ head.t(), atol=1e-5, rtol=1e-5)
    for i in {0, m - 1}:
        assert torch.equal(nat.logits(x[i : i + 1].contiguous(), head, torch.empty(1, vocab)), out[i : i + 1])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_window_in_one_call_equals_its_steps(nat, family, tmp_path):
    """miles_decode_window (each row group through every step on one thread, drawn inside) against the same window made
    step by step with decode_step, logits and sample: the same tokens, logprobs and K/V buffer, bit for bit, for any
    group size; greedy and sampled rows, rows in shuffled buffer rows."""
    make_hf_model(family, tmp_path, head_dim=16)
    core = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, cpu_kernels="native"))
    dec, run = core._cpu, core.runner
    _, _, fn, head_w, nplan = dec._window_statics()
    head = head_w.t()
    assert nplan is not None and cpu_layers.window_group(nplan, 13, head) > 0
    g = torch.Generator().manual_seed(5)
    b, steps, hk, d, cap, col = 13, 4, run.kv_heads, run.head_dim, 48, 21
    heads, hidden = run.model.config.num_heads, run.model.config.hidden_size
    embed = run.model.model.embed_tokens.weight
    tok0 = torch.randint(0, embed.shape[0], (b,), generator=g)
    cos, sin = torch.randn(40, d, generator=g), torch.randn(40, d, generator=g)
    pos = torch.randint(0, 30, (b,), generator=g)
    slot = torch.randperm(b, generator=g)
    keys = torch.randn(run.num_layers, b, hk, cap // 16, d, 16, generator=g)
    values = torch.randn(run.num_layers, b, hk, cap, d, generator=g)
    mask = torch.zeros(b * hk, cap)
    mask[1::3, :5] = float("-inf")
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.7 + 0.1 * (i % 5)) for i in range(b)]
    st = SamplingTensors.build(params, torch.randint(0, 2**62, (b,), generator=g).tolist(), "cpu")
    counters = torch.randint(0, 100, (b,), generator=g)
    inter = cpu_layers.buffers(nplan, b, hidden)[1].shape[1]

    k_l, v_l = keys.clone().unbind(0), values.clone().unbind(0)  # step by step
    bufs, o_buf, x, xn = cpu_layers.buffers(nplan, b, hidden), torch.empty(b, heads * d), torch.empty(b, hidden), torch.empty(b, hidden)
    args, tok, toks, lps = cpu_layers.step_args(nplan, k_l, v_l), tok0, [], []
    for j in range(steps):
        nat.decode_step(tok, embed, x, *args, fn[1:], xn, cos, sin, pos, j, slot, mask, col + j, d**-0.5, bufs, o_buf, heads, hk)
        tok, lp = nat.sample(nat.logits(xn, head, torch.empty(b, head.shape[0])), st.temperature, st.seeds, counters, j)
        toks.append(tok)
        lps.append(lp)
    ref = (torch.stack(toks, 1), torch.stack(lps, 1), torch.stack(k_l), torch.stack(v_l))
    assert not torch.equal(ref[0][1::3], ref[0][1::3].roll(1, 1))  # the sampled rows drew different tokens over the steps
    for group in (1, 4, 13):
        k_l, v_l = keys.clone().unbind(0), values.clone().unbind(0)
        out = nat.decode_window(tok0, embed, *cpu_layers.step_args(nplan, k_l, v_l), fn[1:], head, cos, sin, pos, slot, mask,
                                col, d**-0.5, st.temperature, st.seeds, counters, steps, group, heads, hk, d, inter)
        for a_, b_ in zip((*out, torch.stack(k_l), torch.stack(v_l)), ref):
            assert torch.equal(a_, b_), group


def test_engine_window_in_one_call_matches_step_by_step(nat, tmp_path):
    """The engine with its windows in one call (the default where the weights are small and the draws are the C
    sampler's) against the same engine step by step: the same tokens, logprobs within the lm_head's rounding."""
    make_hf_model("llama", tmp_path, head_dim=16)
    model = load_miles(tmp_path)
    prompts = [[5, 17, 3, 44, 9, 21, 60, 2, 11], [7, 70, 33], list(range(1, 30)), [8, 8, 1]]
    params = [SamplingParams(max_new_tokens=14, temperature=0), SamplingParams(max_new_tokens=20, temperature=0.9, seed=4),
              SamplingParams(max_new_tokens=11, temperature=1.2, seed=7), SamplingParams(max_new_tokens=17, temperature=0)]
    results, calls = {}, []
    for one_call in (True, False):
        core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_kernels="native"))
        core._cpu.whole_window = one_call
        window = core._cpu._native.decode_window
        core._cpu._native.decode_window = lambda *a, **k: calls.append(one_call) or window(*a, **k)
        reqs = [r for p, sp in zip(prompts, params) for r in core.add_request(p, sp, n=2 if sp.temperature else 1)]
        while core.has_unfinished():
            core.step()
        results[one_call] = reqs
    assert calls and all(calls)  # the windows ran in one call, and only where asked
    for a, b in zip(results[True], results[False]):
        assert a.output_ids == b.output_ids and len(a.output_ids) == b.params.max_new_tokens
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_engine_with_and_without_weight_panels_gives_the_same_bits(nat, tmp_path, monkeypatch):
    """The engine with its GEMM weights in panels (the default up to cpu_layers.PACK_WEIGHT_BYTES) and reading W^T
    (above it): the same tokens and logprobs, bit for bit, through prefill, decode windows in one call and step by
    step."""
    make_hf_model("qwen3", tmp_path, head_dim=16)
    model = load_miles(tmp_path)
    prompts = [[5, 17, 3, 44, 9, 21, 60, 2, 11], [7, 70, 33], list(range(1, 30))]
    params = [SamplingParams(max_new_tokens=13, temperature=0), SamplingParams(max_new_tokens=9, temperature=0.9, seed=4),
              SamplingParams(max_new_tokens=11, temperature=0)]
    results = {}
    for cap, one_call in ((2 << 30, True), (2 << 30, False), (0, True), (0, False)):
        monkeypatch.setattr(cpu_layers, "PACK_WEIGHT_BYTES", cap)
        core = EngineCore(model, EngineConfig(block_size=4, decode_steps=3, cpu_kernels="native"))
        core._cpu.whole_window = one_call
        reqs = [r for p, sp in zip(prompts, params) for r in core.add_request(p, sp, n=2)]
        while core.has_unfinished():
            core.step()
        *_, nplan = core._cpu._window_statics()
        assert all((layer.panels is not None) == (cap > 0) for layer in nplan)
        results[cap, one_call] = [(r.output_ids, r.logprobs) for r in reqs]
    assert all(out == results[2 << 30, True] for out in results.values())


def test_an_in_place_change_of_any_gemm_weight_remakes_the_panels(nat, tmp_path):
    """After a generation has built the panel copies, ``update_weights`` of one weight at a time (each GEMM's): the
    engine then generates what a fresh engine with the same weights does, bit for bit, and not what it did before."""
    make_hf_model("llama", tmp_path, head_dim=16)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)

    def generate(core):
        (r,) = core.add_request([5, 17, 3, 44, 9], greedy)
        while core.has_unfinished():
            core.step()
        return r.output_ids, r.logprobs

    core = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, cpu_kernels="native"))
    last, changed = generate(core), {}
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        changed[name] = -3 * core.model.state_dict()[name]
        core.update_weights({name: changed[name]})
        fresh = EngineCore(load_miles(tmp_path), EngineConfig(block_size=4, cpu_kernels="native"))
        fresh.update_weights(changed)
        out = generate(core)
        assert out == generate(fresh) and out[1] != last[1], name
        *_, nplan = core._cpu._window_statics()
        assert all(layer.panels is not None for layer in nplan)
        last = out
    core.release_memory(["weights"])  # the panel copies go with the weights, and come back with them
    assert core._cpu._statics == ()
    core.resume_memory(["weights"])
    assert generate(core) == last


def test_prefill_pieces_cut_the_rows_in_order():
    # chunks (q_len, ctx): 3 fresh rows, 6 rows after 4 cached tokens, 1 row after 9
    assert cpu_layers.pieces([3, 6, 1], [3, 10, 10], 4) == [
        (0, 4, [(0, 3, 3), (1, 1, 5)]), (4, 8, [(1, 4, 9)]), (8, 10, [(1, 1, 10), (2, 1, 10)])]
    assert cpu_layers.pieces([2], [2], 512) == [(0, 2, [(0, 2, 2)])]
