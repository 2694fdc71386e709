"""Triton kernels for the ops of :mod:`miles_core.kernels` (same signatures and semantics)."""
