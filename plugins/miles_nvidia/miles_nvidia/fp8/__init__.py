"""Blockwise-scaled FP8 (e4m3) training and FP8 weight export (DeepSeek-V3 style scaling)."""
