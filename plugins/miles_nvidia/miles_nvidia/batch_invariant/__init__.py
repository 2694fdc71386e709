"""Batch-invariant kernels: a row's result does not depend on what else is in the batch.

He & Thinking Machines Lab 2025, "Defeating Nondeterminism in LLM Inference": a GEMM or a
reduction gives bitwise different results for one row when the batch size changes the kernel's
tiling, split-K or reduction tree. Here every kernel has one fixed configuration, reduces each
row in one fixed order, and never splits a reduction across programs.
"""
