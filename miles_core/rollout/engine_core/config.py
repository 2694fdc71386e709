from __future__ import annotations

from dataclasses import dataclass

from miles_core.errors import ConfigError


CPU_KERNELS = ("auto", "native", "torch")  # EngineConfig.cpu_kernels / rollout.cpu_kernels


@dataclass
class EngineConfig:
    """Sizes and switches of the built-in engine (all have working defaults)."""

    block_size: int = 16  # tokens per KV page
    num_blocks: int | None = None  # KV pages; None = from kv_memory_fraction (GPU) or kv_tokens_cpu
    kv_memory_fraction: float = 0.5  # of the free GPU memory after the weights, for the KV cache
    kv_tokens_cpu: int = 65536  # KV capacity in tokens on CPU when num_blocks is None
    max_num_seqs: int = 256  # sequences decoded at once
    max_batched_tokens: int = 8192  # prompt tokens prefilled per step (longer prompts are chunked)
    max_model_len: int = 8192  # prompt + response, capped by the model's max_position_embeddings
    decode_steps: int = 8  # decode steps run on the device between two host syncs
    # launch the next decode window of an unchanged batch before reading the last one's tokens, so the
    # host's bookkeeping overlaps the device's work (core.py); off: each window is read before the next starts
    overlap_windows: bool = True
    cuda_graphs: bool = True  # capture decode in CUDA graphs (GPU only)
    # with cuda_graphs and Triton: the sampler (no top-k/top-p/min-p filter, no top logprobs) and the step's
    # input updates captured in the decode step's graph, so a step is one replay (runner.decode_sample)
    graph_sampling: bool = True
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
    triton_decode: bool = True  # the Triton paged-decode kernel on GPU (falls back to torch)
    fused_kernels: bool = True  # GPU: the fused Triton layer kernels of triton_fused.py (with triton_decode)
    # GPU, with fused_kernels: at decode of <= 64 rows, the q/k/v prologue (norm, rotary, K/V write) runs inside
    # the paged-attention kernel (triton_decode.paged_decode_qkv) instead of as a kernel of its own
    fused_attention: bool = True
    splitk_gemm: bool = True  # GPU, with fused_kernels: o_proj/down_proj for <= 64 rows through triton_gemm.py's split-K kernel
    gated_gemm: bool = True  # GPU, with fused_kernels: gate/up GEMM + SwiGLU in one Triton kernel for <= 64 rows
    # GPU sm90+, with fused_kernels: the layer kernels launched as programmatic dependents, the GEMMs
    # prefetching their weights into L2 while the kernel before them runs; q/k/v through a Triton GEMM
    # for <= 64 rows so that it joins the chain (triton_pdl.py)
    pdl: bool = True
    pdl_prefetch: bool = True  # with pdl: the GEMMs' L2 weight prefetch (off: PDL alone, to measure each)
    # GPU, with CUDA graphs and Triton: a decode step whose graph bucket (graph_batch_sizes) has at least this many
    # rows runs as two half-batches on two streams (branches of its graph), so one half's attention overlaps the
    # other's GEMMs (runner._decode_halves); 0: never
    split_decode_rows: int = 0
    prefix_caching: bool = True  # reuse full KV pages of identical prefixes across requests
    # Decode through the same scaled_dot_product_attention call as prefill and the trainer (no CUDA
    # graphs, no Triton, no decode window): slower, but a precision recipe's kernel mode then sees the
    # same ops in rollout and training. Turned on by a batch-invariant precision recipe.
    exact_attention: bool = False
    # CPU: run each decode window through cpu_decode.py (context gathered once per window, one SDPA
    # call per layer and step, inference mode): same tokens, a fraction of the host overhead. False
    # keeps the generic eager path (runner.decode). No effect on GPU or with exact_attention.
    cpu_decode_window: bool = True
    # CPU, fp32: "auto" runs prefill, the decode window's steps and sampling through the C kernels of cpu_native.c
    # (built with the system C compiler at first use; torch ops where it fails), "native" the same but an error
    # where they do not build, "torch" the torch ops only
    cpu_kernels: str = "auto"

    def validate(self) -> None:
        for key in ("block_size", "max_num_seqs", "max_batched_tokens", "max_model_len", "decode_steps"):
            if getattr(self, key) < 1:
                raise ConfigError(f"engine.{key} must be >= 1, got {getattr(self, key)}")
        if self.split_decode_rows < 0:
            raise ConfigError(f"engine.split_decode_rows must be >= 0 (0: never split), got {self.split_decode_rows}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"engine.num_blocks must be >= 2, got {self.num_blocks}")
        if self.cpu_kernels not in CPU_KERNELS:
            raise ConfigError(f"engine.cpu_kernels must be 'auto', 'native' or 'torch', got {self.cpu_kernels!r}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"engine.kv_memory_fraction must be in (0, 1], got {self.kv_memory_fraction}")
