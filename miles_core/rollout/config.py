from __future__ import annotations

from dataclasses import dataclass, field

from miles_core.errors import ConfigError
from miles_core.rollout.engine_core.config import CPU_KERNELS
from miles_core.rollout.sglang.config import SglangConfig

ROLLOUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RolloutConfig:
    backend: str = "builtin"  # a registered rollout backend
    batch_size: int = 16  # prompts per step (--rollout-batch-size)
    n_samples_per_prompt: int = 8  # group size (--n-samples-per-prompt)
    max_response_len: int = 32  # new tokens per sample (--rollout-max-response-len)
    temperature: float = 1.0  # (--rollout-temperature); 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop: list[str] = field(default_factory=list)  # stop strings, besides the tokenizer's eos
    max_batch_size: int = 512  # sequences the engine decodes at once
    # built-in engine: decode steps between two host syncs (0 = its default, 8). Larger leaves the GPU
    # fewer idle gaps; a sequence that ends inside a window waits for the window's end.
    decode_steps: int = 0
    # built-in engine weights and KV cache: auto = on GPU the precision recipe's compute dtype (bf16 for
    # train.precision=bf16, as an SGLang server would serve it), else the trainer's weight dtype; a
    # batch-invariant recipe keeps the trainer's dtype (its kernel mode needs the same ops) | float32 | bfloat16 | float16
    dtype: str = "auto"
    # built-in engine on GPU: the share of the free memory (after its weights) taken for the KV cache,
    # once at start-up; 0 = the engine's default (0.5). Lower it when the trainer shares the GPU.
    kv_memory_fraction: float = 0.0
    # built-in engine on CPU, fp32: auto = prefill, decode and sampling through the C kernels (built with the
    # system C compiler at first use; torch ops where that fails) | native (an error where they do not build) | torch
    cpu_kernels: str = "auto"
    sglang: SglangConfig = field(default_factory=SglangConfig)  # rollout.backend=sglang

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"rollout.batch_size must be >= 1, got {self.batch_size}")
        if self.n_samples_per_prompt < 1:
            raise ConfigError(f"rollout.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.max_response_len < 1:
            raise ConfigError(f"rollout.max_response_len must be >= 1, got {self.max_response_len}")
        if self.temperature < 0:
            raise ConfigError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_batch_size < 1:
            raise ConfigError(f"rollout.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.decode_steps < 0:
            raise ConfigError(f"rollout.decode_steps must be >= 0, got {self.decode_steps}")
        if self.dtype not in ROLLOUT_DTYPES:
            raise ConfigError(f"rollout.dtype must be one of {', '.join(ROLLOUT_DTYPES)}, got '{self.dtype}'")
        if not 0 <= self.kv_memory_fraction <= 1:
            raise ConfigError(f"rollout.kv_memory_fraction must be in [0, 1] (0 = the engine's default), got {self.kv_memory_fraction}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ConfigError(f"rollout.cpu_kernels must be 'auto', 'native' or 'torch', got '{self.cpu_kernels}'")
        if self.top_k < 0:
            raise ConfigError(f"rollout.top_k must be >= 0, got {self.top_k}")
        self.sglang.validate()
