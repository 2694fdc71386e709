"""The fp32 CPU kernels of the engine (``cpu_native.c``: decode window, prefill, sampling), built with the system's C compiler.

:meth:`NativeKernels.load` compiles ``cpu_native.c`` once per source, compiler and CPU into a cache
folder (``$MILES_CACHE_DIR/native``, else ``$XDG_CACHE_HOME/miles/native``, else
``~/.cache/miles/native``; the temporary folder where that cannot be made; about a second) and
loads it with :mod:`ctypes`; later loads find the library there. It is built with ``-march=native``,
so the CPU's flags are part of the cache key: a cache folder shared by different machines holds one
build per kind of CPU. The kernels take raw
pointers: the callers pass contiguous fp32 CPU tensors of the shapes documented on each method
(:mod:`.cpu_decode` does).

``EngineConfig.cpu_kernels`` picks them: ``"auto"`` (the default) uses them when they build and falls
back to the torch ops with one warning when they do not (no C compiler, say); ``"native"`` raises
instead; ``"torch"`` never builds them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from miles_core.errors import ConfigError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-ffp-contract=off", "-std=gnu11"]
MAX_HEAD_DIM = 256  # the kernels' limit (cpu_native.c); D must also be a multiple of 16
KEY_BLOCK = 16  # columns per block of the keys' layout [B, Hk, cap / KEY_BLOCK, D, KEY_BLOCK] (one v16 in cpu_native.c)


class NativeBuildError(ConfigError):
    """The C compiler is missing or failed; the message holds its output. A user error where
    ``cpu_kernels="native"`` asked for the kernels (the CLI prints it and exits 2); ``"auto"`` logs it."""


def cache_dir() -> Path:
    if os.environ.get("MILES_CACHE_DIR"):
        return Path(os.environ["MILES_CACHE_DIR"]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "miles" / "native"


def _cpu_signature() -> str:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``): what ``-march=native`` compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(out_dir: Path | None = None, cc: str | None = None) -> Path:
    """Compile ``cpu_native.c`` (with OpenMP when the compiler has it) unless a build for this source,
    compiler and CPU is already in ``out_dir``; return the library's path. The library is written
    under a temporary name and renamed into place, so concurrent builds never load a half-written file."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc or not shutil.which(cc.split()[0]):
        raise NativeBuildError(f"no C compiler found (set CC, or install gcc or clang); tried {cc or 'cc, gcc, clang'}")
    out_dir = Path(out_dir or cache_dir())
    try:
        version = subprocess.run([*cc.split(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"C compiler {cc!r} does not run: {e}") from e
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, " ".join(FLAGS), platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    lib = out_dir / f"cpu_native-{key}.so"
    if lib.exists():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home, say: the build goes to the temporary folder
        log.info("cache folder %s not writable (%s); building under %s", out_dir, e, tempfile.gettempdir())
        out_dir = Path(tempfile.gettempdir()) / f"miles-native-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        lib = out_dir / lib.name
        if lib.exists():
            return lib
        out_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in (["-fopenmp"], []):  # without OpenMP the kernels run on one thread
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        cmd = [*cc.split(), *FLAGS, *extra, str(SOURCE), "-o", tmp, "-lm"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            res = None
            errors.append(f"{' '.join(cmd)}: {e}")
        if res is not None and res.returncode == 0:
            os.replace(tmp, lib)
            return lib
        if res is not None:
            errors.append(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr.strip()[-2000:]}")
        Path(tmp).unlink(missing_ok=True)
    raise NativeBuildError("building the CPU decode kernels failed:\n" + "\n".join(errors))


def panels_shape(k: int, n: int, swiglu: bool) -> tuple[int, int, int]:
    """The shape of :meth:`NativeKernels.pack`'s panels of a W^T [k, n]."""
    per = 32 if swiglu else 64
    return -(-(n // (2 if swiglu else 1)) // per), k, 64


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeKernels:
    """The loaded library. Every tensor argument is a contiguous fp32 CPU tensor (rows may be strided
    where a ``*_stride`` is passed: the row stride in elements)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._rmsnorm = lib.miles_rmsnorm
        self._rmsnorm.argtypes = [p, i, p, p, i, i, f]
        self._silu_mul = lib.miles_silu_mul
        self._silu_mul.argtypes = [p, p, i, i]
        self._attn = lib.miles_attn_step
        self._attn.argtypes = [p, i, p, p, i, p, i, p, p, p, f, p, p, p, p, i, i, i, i, i, i, f]
        self._prefill_rope = lib.miles_prefill_rope
        self._prefill_rope.argtypes = [p, i, p, p, p, p, p, f, p, p, p, i, i, i, i]
        self._prefill_attn = lib.miles_prefill_attn
        self._prefill_attn.argtypes = [p, i, p, p, p, i, i, p, p, p, p, i, i, i, i, i, f]
        self._sample = lib.miles_sample
        self._sample.argtypes = [p, i, p, p, p, i, p, p, i, i]
        self._gemm = lib.miles_gemm
        self._gemm.argtypes = [p, i, p, p, i, p, i, i, i, ctypes.c_int, ctypes.c_int]
        self._pack = lib.miles_pack
        self._pack.argtypes = [p, p, i, i, ctypes.c_int]
        self._write_back = lib.miles_write_back
        self._write_back.argtypes = [p, p, p, p, i, i, p, p, i, i, i, i, i, i, i, i, i]
        self._step = lib.miles_decode_step
        self._step.argtypes = [p, p, p, p, p, i, p, f, p, p, p, i, p, i, p, p, i, f, p, p, p, p, i, i, i, i, i, i, i, ctypes.c_int]
        self._gather = lib.miles_gather
        self._gather.argtypes = [p, p, i, i, p, p, p, i, i, i, i, i, i, i, i]
        self._logits = lib.miles_logits
        self._logits.argtypes = [p, i, p, p, i, i]
        self._window = lib.miles_decode_window
        self._window.argtypes = [p, p, p, p, i, p, f, p, i, p, p, i, p, p, p, i, f, p, p, p, p, p, i, i, i, i, i, i, i, i, i,
                                 ctypes.c_int]
        for fn in (self._rmsnorm, self._silu_mul, self._attn, self._prefill_rope, self._prefill_attn, self._sample, self._gemm, self._pack,
                   self._write_back, self._step, self._gather, self._logits, self._window):
            fn.restype = None

    @classmethod
    def load(cls, mode: str = "auto") -> NativeKernels | None:
        """The kernels for ``EngineConfig.cpu_kernels`` = ``mode``: None for ``"torch"``, and for
        ``"auto"`` when they do not build (logged once per load); ``"native"`` raises then."""
        if mode == "torch":
            return None
        try:
            return cls(build())
        except (NativeBuildError, OSError) as e:
            if mode == "native":
                raise NativeBuildError(f"engine.cpu_kernels='native' (rollout.cpu_kernels): {e}") from e
            log.warning("CPU decode kernels unavailable, decoding with torch ops (engine.cpu_kernels='torch' "
                        "silences this): %s", e)
            return None

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
        """``out[r] = weight * x[r] * rsqrt(mean(x[r]^2) + eps)``; x [rows, n] (row stride free), out [rows, n]."""
        rows, n = x.shape
        self._rmsnorm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, n, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = silu(gate) * up`` with ``gate_up = [gate | up]`` [rows, 2I]; out [rows, I]."""
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1])
        return out

    def attn_step(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_w: torch.Tensor | None,
                  k_w: torch.Tensor | None, qk_eps: float, kb: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  out: torch.Tensor, heads: int, col: int, scale: float, pos: torch.Tensor | None = None,
                  pos_off: int = 0, slot: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's decode attention: qkv [B, (H + 2 Hk) D] (row stride free); cos, sin [B, D] (row stride
        free), or with ``pos`` [B] int64 the tables [P, D] (contiguous) read at rows ``pos + pos_off``; q_w, k_w
        [D] per-head RMSNorm weights or None; kb [NS, Hk, cap / 16, D, 16] (K in blocks of 16 columns), v [NS, Hk,
        cap, D], mask [NS * Hk, cap]: buffer row ``slot[b]`` ([B] int64) is row b's, or row b itself without ``slot``
        (NS = B); out [B, H D]. Writes the new K/V into column ``col`` and attends over columns ``[0, col]``."""
        b = qkv.shape[0]
        _, hk, nb, d, _ = kb.shape
        self._attn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), d if pos is not None else cos.stride(0),
                   _ptr(pos), pos_off, _ptr(slot), _ptr(q_w), _ptr(k_w), qk_eps, kb.data_ptr(), v.data_ptr(), mask.data_ptr(), out.data_ptr(),
                   b, heads, hk, d, nb * KEY_BLOCK, col, scale)
        return out

    def prefill_rope(self, qkv: torch.Tensor, positions: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor,
                     q_w: torch.Tensor | None, k_w: torch.Tensor | None, qk_eps: float, kc: torch.Tensor, vc: torch.Tensor,
                     slots: torch.Tensor, heads: int) -> torch.Tensor:
        """A prefill layer's prologue, in place: qkv [N, (H + 2 Hk) D] (row stride free) gets its q and k heads
        normed (q_w, k_w [D] or None) and rotated at ``positions`` [N] int64 (tables cos_t, sin_t [P, D], sin
        unsigned); then each row's K and V go into the paged cache kc, vc [S, Hk, D] at ``slots`` [N] int64."""
        n = qkv.shape[0]
        hk, d = kc.shape[1], kc.shape[2]
        self._prefill_rope(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(), _ptr(q_w),
                           _ptr(k_w), qk_eps, kc.data_ptr(), vc.data_ptr(), slots.data_ptr(), n, heads, hk, d)
        return qkv

    def prefill_attn(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, page: int,
                     q_start: torch.Tensor, q_len: torch.Tensor, ctx: torch.Tensor, out: torch.Tensor, heads: int,
                     max_ctx: int, scale: float) -> torch.Tensor:
        """A prefill layer's causal attention: sequence b's ``q_len[b]`` rows start at flat row ``q_start[b]`` of
        qkv [N, (H + 2 Hk) D] (rotated queries, row stride free) and end at position ``ctx[b] - 1``; its keys and
        values (positions < ctx[b], the new ones included) are in kc, vc [S, Hk, D] on the pages of ``tables``
        [B, W] int64, ``page`` slots each. q_start, q_len, ctx [B] int64, max_ctx >= max(ctx); out [N, H D]."""
        hk, d = kc.shape[1], kc.shape[2]
        self._prefill_attn(qkv.data_ptr(), qkv.stride(0), kc.data_ptr(), vc.data_ptr(), tables.data_ptr(), tables.stride(0),
                           page, q_start.data_ptr(), q_len.data_ptr(), ctx.data_ptr(), out.data_ptr(), q_len.shape[0], heads, hk,
                           d, max_ctx, scale)
        return out

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor,
               offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`.sampler.sample_torch` for rows with no top-k / top-p / min-p filter and no top logprobs:
        logits [B, V] (row stride free), temperature [B] fp32 (<= 0: greedy), seeds, counters [B] int64 (the
        draw of row b is that of output position ``counters[b] + offset``). Returns (tokens [B] int64, logprobs [B])."""
        b, v = logits.shape
        tok, lp = torch.empty(b, dtype=torch.int64), torch.empty(b)
        self._sample(logits.data_ptr(), logits.stride(0), temperature.data_ptr(), seeds.data_ptr(), counters.data_ptr(),
                     offset, tok.data_ptr(), lp.data_ptr(), b, v)
        return tok, lp

    def gemm(self, x: torch.Tensor, wt: torch.Tensor, out: torch.Tensor, add: torch.Tensor | None = None,
             swiglu: bool = False) -> torch.Tensor:
        """``out = x @ wt (+ add)``, or with ``swiglu`` ``silu(x @ wt[:, :I]) * (x @ wt[:, I:])``: x [M, K] and add
        [M, N] (row strides free), wt [K, N] contiguous or its panels (:meth:`pack`, 3-D), out [M, N] (or [M, I],
        I = N / 2) contiguous; N (or I) a multiple of 16. Either layout gives the same bits."""
        m, k = x.shape
        packed = wt.dim() == 3
        n = out.shape[1] * (2 if swiglu else 1) if packed else wt.shape[1]
        assert wt.is_contiguous() and out.is_contiguous() and (not packed or wt.shape == panels_shape(k, n, swiglu)), wt.shape
        self._gemm(x.data_ptr(), x.stride(0), wt.data_ptr(), _ptr(add), 0 if add is None else add.stride(0), out.data_ptr(),
                   m, k, n, int(swiglu), int(packed))
        return out

    def pack(self, wt: torch.Tensor, swiglu: bool = False) -> torch.Tensor:
        """W^T [K, N] (contiguous) in the GEMMs' panel layout, [G, K, 64]: each group of 64 output columns (with
        ``swiglu``, N = 2 I: 32 gate columns and their 32 up columns) one contiguous run of K rows, zeros past the
        last column (:func:`panels_shape`). A copy: it does not follow later changes of ``wt``."""
        k, n = wt.shape
        assert wt.is_contiguous() and wt.dtype == torch.float32 and (n // (2 if swiglu else 1)) % 16 == 0, (wt.shape, swiglu)
        out = torch.empty(panels_shape(k, n, swiglu))
        self._pack(wt.data_ptr(), out.data_ptr(), k, n, int(swiglu))
        return out

    def write_back(self, kb: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, page: int,
                   pos0: torch.Tensor, slot: torch.Tensor, t0: int, steps: int) -> None:
        """A decode window's new K/V into the paged cache: columns ``t0 .. t0 + steps - 1`` of the window buffer, kb
        [L, NS, Hk, cap / 16, D, 16] and v [L, NS, Hk, cap, D], into kv [L, 2, S, Hk, D]: row b (buffer row
        ``slot[b]``) step j (position ``pos0[b] + j``) on its page of ``tables`` [B, W] int32 (``page`` slots each;
        columns past W - 1 clamp to the last, whose slots are padding). pos0, slot [B] int64."""
        nl, ns, hk, nb, d, _ = kb.shape
        assert kv.is_contiguous() and tables.is_contiguous() and tables.dtype == torch.int32 and pos0.is_contiguous()
        assert slot.is_contiguous() and slot.dtype == torch.int64
        self._write_back(kb.data_ptr(), v.data_ptr(), kv.data_ptr(), tables.data_ptr(), tables.shape[1], page, pos0.data_ptr(),
                         slot.data_ptr(), nl, slot.shape[0], ns, hk, d, nb * KEY_BLOCK, kv.shape[2], t0, steps)

    def gather(self, kv: torch.Tensor, tables: torch.Tensor, page: int, slot: torch.Tensor, kb: torch.Tensor, v: torch.Tensor,
               t0: int) -> None:
        """Rows into a window buffer: row b's first ``t0`` positions from the paged cache kv [L, 2, S, Hk, D], on its
        pages in ``tables`` [B, W] int32 (``page`` slots each), into buffer row ``slot[b]`` ([B] int64) of kb [L, NS,
        Hk, cap / 16, D, 16] and v [L, NS, Hk, cap, D]; the row's later columns are zeroed."""
        nl, ns, hk, nb, d, _ = kb.shape
        assert kv.is_contiguous() and tables.is_contiguous() and tables.dtype == torch.int32 and tables.shape[1] * page >= t0
        assert slot.is_contiguous() and slot.dtype == torch.int64 and kb.is_contiguous() and v.is_contiguous()
        self._gather(kv.data_ptr(), tables.data_ptr(), tables.shape[1], page, slot.data_ptr(), kb.data_ptr(), v.data_ptr(), nl,
                     slot.shape[0], ns, hk, d, nb * KEY_BLOCK, kv.shape[2], t0)

    def decode_step(self, tok: torch.Tensor, embed: torch.Tensor, x: torch.Tensor, ptrs: torch.Tensor, eps: torch.Tensor,
                    packed: bool, final_norm: tuple, xn: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor,
                    pos_off: int, slot: torch.Tensor, mask: torch.Tensor, col: int, scale: float, bufs: tuple, o: torch.Tensor,
                    heads: int, kv_heads: int) -> torch.Tensor:
        """One decode step in one call: x [B, hidden] = rows ``tok`` [B] int64 of ``embed`` [V, hidden], then every
        layer in place (``ptrs`` [L, 10], ``eps`` [L, 3] and ``packed``, the GEMM weights' layout, from
        :func:`.cpu_layers.step_args`; the rotary tables
        cos_t, sin_t [P, D] read at rows ``pos + pos_off`` (pos [B] int64), row b's K/V and mask in buffer row
        ``slot[b]`` ([B] int64), mask [NS * Hk, cap] and column ``col`` as :meth:`attn_step`), then ``xn`` [B, hidden] = the final norm of x (``final_norm`` = (weight, eps)).
        ``bufs`` = (norm [B, hidden], SwiGLU [B, I], q/k/v [B, (H + 2 Hk) D]) and o [B, H D]; every tensor
        contiguous. Returns xn."""
        h, a, qkv = bufs
        b, hidden = x.shape
        d = qkv.shape[1] // (heads + 2 * kv_heads)
        self._step(tok.data_ptr(), embed.data_ptr(), x.data_ptr(), ptrs.data_ptr(), eps.data_ptr(), ptrs.shape[0],
                   final_norm[0].data_ptr(), final_norm[1], xn.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(), d, pos.data_ptr(),
                   pos_off, slot.data_ptr(), mask.data_ptr(), col, scale, h.data_ptr(), qkv.data_ptr(), o.data_ptr(), a.data_ptr(), b, hidden,
                   heads, kv_heads, d, a.shape[1], mask.shape[1], int(packed))
        return xn

    def logits(self, x: torch.Tensor, head: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = x @ head^T``: x [M, hidden], head [V, hidden] (the lm_head weight as stored), out [M, V], all
        contiguous; the sums as :meth:`decode_window`'s."""
        assert x.is_contiguous() and head.is_contiguous() and out.is_contiguous()
        self._logits(x.data_ptr(), x.shape[0], head.data_ptr(), out.data_ptr(), head.shape[0], head.shape[1])
        return out

    def decode_window(self, tok: torch.Tensor, embed: torch.Tensor, ptrs: torch.Tensor, eps: torch.Tensor, packed: bool,
                      final_norm: tuple,
                      head: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
                      mask: torch.Tensor, col: int, scale: float, temperature: torch.Tensor, seeds: torch.Tensor,
                      counters: torch.Tensor, steps: int, group: int, heads: int, kv_heads: int, head_dim: int,
                      inter: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``steps`` decode steps in one call, the rows in groups of ``group`` (one thread takes a group through
        every step): per step :meth:`decode_step`'s embedding, layers and final norm (step j at rotary row ``pos +
        j``, column ``col + j``), :meth:`logits` against ``head`` [V, hidden], and :meth:`sample`'s draw for output
        position ``counters + j``, whose token feeds step j + 1. ``tok`` [B] int64 feeds step 0; the other
        arguments as :meth:`decode_step`'s and :meth:`sample`'s, every tensor contiguous. Returns (tokens [B,
        steps] int64, logprobs [B, steps]), the same bits as those calls made step by step."""
        b, (v, hidden) = tok.shape[0], head.shape
        tensors = (tok, embed, ptrs, eps, final_norm[0], head, cos_t, sin_t, pos, slot, mask, temperature, seeds, counters)
        assert all(t.is_contiguous() for t in tensors) and temperature.dtype == torch.float32
        assert all(t.dtype == torch.int64 and t.shape == (b,) for t in (tok, pos, slot, seeds, counters)) and group >= 1
        toks, lps = torch.empty(b, steps, dtype=torch.int64), torch.empty(b, steps)
        self._window(tok.data_ptr(), embed.data_ptr(), ptrs.data_ptr(), eps.data_ptr(), ptrs.shape[0], final_norm[0].data_ptr(),
                     final_norm[1], head.data_ptr(), v, cos_t.data_ptr(), sin_t.data_ptr(), head_dim, pos.data_ptr(),
                     slot.data_ptr(), mask.data_ptr(), col, scale, temperature.data_ptr(), seeds.data_ptr(), counters.data_ptr(),
                     toks.data_ptr(), lps.data_ptr(), b, steps, group, hidden, heads, kv_heads, head_dim, inter, mask.shape[1],
                     int(packed))
        return toks, lps
