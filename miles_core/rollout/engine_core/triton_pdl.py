"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, and an L2 weight prefetch.

A decode step is a chain of small kernels (per layer: q/k/v GEMM, prologue, attention, o_proj, add +
norm, gate/up, down_proj, add + norm). Without PDL a kernel starts only after its predecessor has
finished and been retired, a gap of a few µs each. With PDL (sm90+, CUDA >= 12.3; a launch attribute,
kept by CUDA-graph capture) a kernel may be launched while its predecessor still runs:

* every kernel of the chain calls :func:`pdl_wait` before it reads anything a predecessor wrote:
  ``griddepcontrol.wait`` blocks until the predecessor grids have *completed* and their writes are
  visible; then ``griddepcontrol.launch_dependents`` lets the next kernel be scheduled. A kernel calls
  it in every program, before its first such load and before any store, so the chain keeps stream
  order: no kernel reads or overwrites what a predecessor still uses.
* what a kernel reads that no kernel of the step writes -- the weights -- it may touch before the
  wait: the GEMM kernels issue ``prefetch.global.L2`` for their whole weight slice there
  (:func:`prefetch_l2`), so that the weight stream, the bulk of a decode GEMM's bytes, starts during the
  predecessor's tail instead of after it.

NVIDIA, CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX ISA,
``griddepcontrol`` and ``prefetch``. Off (constexpr ``PDL=False``) the kernels compile as before, and
on CPU / under the Triton interpreter it is always off.
"""

from __future__ import annotations

import torch

from miles_core.rollout.engine_core.triton_lib import tl, triton


def supported(device: torch.device) -> bool:
    """PDL needs an sm90+ GPU and a Triton that has the ``griddepcontrol`` intrinsics."""
    if triton is None or device.type != "cuda":
        return False
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:  # pragma: no cover - depends on the install
        return False
    return hasattr(tl_cuda, "gdc_wait") and torch.cuda.get_device_capability(device) >= (9, 0)


def launch_opts(pdl: bool) -> dict:
    """Keyword arguments of a Triton launch: the PDL launch attribute when ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """Wait for the predecessor grids (their writes visible), then let the next kernel launch."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, ON: tl.constexpr):
        """``prefetch.global.L2`` of the 128-byte lines at ``ptrs`` (a block of pointers, one per line), if ``ON``."""
        if ON:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def prefetch_rows(W, rows, s_w, k_lo, k_hi, LINE: tl.constexpr, LINES: tl.constexpr, ON: tl.constexpr):
        """Prefetch ``W[rows, k_lo:k_hi]`` into L2, ``LINE`` elements per 128-byte line, ``LINES`` (a power of
        two, at least ``cdiv(k_hi - k_lo, LINE)``) lines per row; lines past ``k_hi`` repeat its last element
        (an empty range, ``k_hi <= k_lo``, touches only ``k_hi - 1``: pass ``k_hi >= 1``). Nothing unless ``ON``."""
        if ON:
            offs = tl.minimum(k_lo + tl.arange(0, LINES) * LINE, k_hi - 1)
            prefetch_l2(W + rows[:, None] * s_w + offs[None, :], ON)


def lines(k_len: int, elem_bytes: int) -> tuple[int, int]:
    """(elements per 128-byte line, lines per row as a power of two) for a row slice of ``k_len`` elements."""
    line = max(1, 128 // elem_bytes)
    return line, triton.next_power_of_2(max(1, -(-k_len // line)))
