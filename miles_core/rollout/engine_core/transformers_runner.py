"""The engine's runner for architectures Miles has no implementation of: any transformers causal LM,
over the same paged KV cache, so the engine core (continuous batching, prefix sharing, chunked
prefill, sampling, aborts, weight updates) serves it unchanged.

The model is loaded with its attention implementation set to :data:`ATTENTION`, a function
registered in transformers' ``AttentionInterface`` (the library's documented extension point).
Each forward passes a :class:`PagedStep` as the keyword ``miles_step``; transformers hands the
model's keyword arguments down to every attention call, so :func:`paged_attention_forward` gets it
with the layer's rotated q/k/v ``[1, heads, N, D]``, writes k/v into the layer's pages and
attends through :mod:`.attention`'s torch functions (the step's tokens are one flat row: no padding,
no HF cache, ``use_cache=False``). Everything else (embeddings, norms, rotary, MLP, lm_head and any
scaling or soft-capping of the logits) is the transformers model's own code.

Slower than the native families: eager PyTorch, no CUDA graphs, no fused or Triton kernels, no
CPU decode window; a decode window gathers its rows' K/V once (:class:`~.runner.DecodeWindow`).
Refused with a clear error: a model whose attention does not go through the interface on every
layer (e.g. recurrent or hybrid layers), attention logit soft-capping, attention sinks, K/V
head shapes that differ from the config's (multi-head latent attention), and attention that depends
on positions other than through rotary embeddings and a sliding window (Llama 4's chunked attention
and query temperature tuning, ALiBi: :func:`position_dependent_attention`). MoE models run, but their
routing is not recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from miles_core.errors import ConfigError
from miles_core.rollout.engine_core.attention import AttnBatch, paged_attention
from miles_core.rollout.engine_core.config import EngineConfig
from miles_core.rollout.engine_core.runner import DecodeWindow

ATTENTION = "miles_paged"  # the attention implementation name registered in transformers


@dataclass
class PagedStep:
    """What one forward's attention calls need: the cache, where the step's tokens go, and either the
    prefill metadata or the decode window. ``calls`` counts the layers that attended."""

    kv: torch.Tensor  # [L, 2, S, Hk, D]
    slots: torch.Tensor  # [N] cache slot of each of the step's tokens
    block_size: int
    prefill: AttnBatch | None = None
    window: DecodeWindow | None = None  # decode: the window's K/V, gathered once
    calls: int = 0


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            softcap: float | None = None, miles_step: PagedStep | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` [1, H, N, D], ``key``/``value`` [1, Hk, N, D]
    -> (output [1, N, H, D], no weights). ``attention_mask`` is unused: positions come from the step.

    The sliding window is the call's ``sliding_window`` keyword; a model that does not pass one (Qwen2-MoE) keeps
    its sliding layers' window on the module and applies it through the mask alone, so the module's is taken (PhiMoE
    keeps it in its config only: :func:`load_transformers_model` puts it on the modules)."""
    step = miles_step
    sliding_window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if step is None:  # called outside the engine, or the model's layers drop their keyword arguments
        raise ConfigError(f"model '{getattr(getattr(module, 'config', None), 'model_type', '?')}': its attention was called without "
                          "the engine's paged-cache step (its layers do not pass keyword arguments down to attention), so the "
                          "engine's transformers path cannot serve it")
    if softcap is not None:
        raise ConfigError("this model soft-caps its attention logits, which the engine's transformers path does not support")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ConfigError("this model uses attention sinks, which the engine's transformers path does not support")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ConfigError(f"attention module {type(module).__name__} has no layer_idx: the engine cannot tell its cache layer")
    kv = step.kv
    if key.shape[1] != kv.shape[3] or key.shape[-1] != kv.shape[4] or value.shape[-1] != kv.shape[4]:
        raise ConfigError(f"layer {layer}'s K/V heads {tuple(key.shape[1::2])}/{tuple(value.shape[1::2])} do not match the "
                          f"cache's ({kv.shape[3]}, {kv.shape[4]}) from the model config: not supported by the transformers path")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, D]
    kc, vc = kv[layer, 0], kv[layer, 1]
    kc.index_copy_(0, step.slots, k.to(kc.dtype))
    vc.index_copy_(0, step.slots, v.to(vc.dtype))
    if step.prefill is not None:
        out = paged_attention(q, kc, vc, step.prefill, step.block_size, scale=scaling, window=sliding_window)
    else:
        step.window.push(layer, k, v)
        out = step.window.attend(q, scale=scaling, window=sliding_window)
    step.calls += 1
    return out[None], None


def load_transformers_model(path: str | Path) -> nn.Module:
    """An HF folder of any architecture transformers knows -> its ``AutoModelForCausalLM`` (eval, in the
    dtype transformers picks; the caller casts it), with :data:`ATTENTION` as its attention
    implementation. Local files only; no remote code."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ATTENTION, paged_attention_forward)  # idempotent: the same function each time
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=ATTENTION, local_files_only=True)
    except (ValueError, KeyError, OSError, ImportError) as exc:
        raise ConfigError(f"model checkpoint '{path}': transformers cannot load it as a causal LM ({exc})") from exc
    cfg = model.config
    if getattr(cfg, "attn_logit_softcapping", None):
        raise ConfigError(f"model checkpoint '{path}' ({cfg.model_type}) soft-caps its attention logits, which the engine's "
                          "transformers path does not support")
    reason = position_dependent_attention(cfg)
    if reason is not None:
        raise ConfigError(f"model checkpoint '{path}' ({cfg.model_type}) uses {reason}, which the engine's transformers path "
                          "does not support")
    window = getattr(cfg, "sliding_window", None)
    if cfg.model_type in CONFIG_ONLY_WINDOW and window:
        for module in model.modules():  # the attention modules: where paged_attention_forward looks for a window
            if getattr(module, "layer_idx", None) is not None:
                module.sliding_window = window
    return model.eval()


# models that apply ``config.sliding_window`` (to every layer) through their attention mask alone: neither the
# attention call nor the module carries it, so the loader puts it on the module
CONFIG_ONLY_WINDOW = frozenset({"phimoe"})


def position_dependent_attention(cfg) -> str | None:
    """What in a transformers config makes attention depend on more than the causal order, a sliding window and
    the step's ``position_ids``, or None. Such a model computes another function over the paged cache, silently:
    chunked attention (Llama 4's ``attention_chunk_size``) reaches the attention function only as the
    ``attention_mask``, which the paged path does not read; Llama 4's ``attn_temperature_tuning`` scales the
    queries of its NoPE layers by positions the module counts from its HF cache (none here), not the tokens'; an
    ALiBi bias (Falcon's ``alibi``) is added to the ``attention_mask`` too."""
    if getattr(cfg, "alibi", False):
        return "ALiBi position biases (alibi)"
    if "chunked_attention" in (getattr(cfg, "layer_types", None) or []):
        return f"chunked attention (attention_chunk_size {getattr(cfg, 'attention_chunk_size', None)})"
    if getattr(cfg, "attn_temperature_tuning", False) and 0 in (getattr(cfg, "no_rope_layers", None) or []):
        return "attention temperature tuning on its NoPE layers (attn_temperature_tuning)"
    return None


def is_transformers_model(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == ATTENTION


class TransformersRunner:
    """The part of :class:`~.runner.ModelRunner`'s interface the engine core uses, for a transformers
    model on its eager path: flat-token prefill and one decode step at a time over the static buffers
    (``tokens``, ``positions``, ``ctx_lens``, ``block_tables``) that the core fills."""

    use_graphs = False
    use_triton = False
    fused_kernels = False
    varlen_prefill = False
    is_moe = False  # routing is not recorded for transformers models

    def __init__(self, model: nn.Module, cfg: EngineConfig, device: torch.device, extra_blocks: int) -> None:
        if cfg.exact_attention:
            raise ConfigError("engine.exact_attention (a batch-invariant recipe) needs a native Miles model family, "
                              f"not the transformers path ({model.config.model_type})")
        self.model, self.cfg, self.device = model, cfg, device
        hc = model.config
        self.num_layers = hc.num_hidden_layers
        heads = hc.num_attention_heads
        self.kv_heads = getattr(hc, "num_key_value_heads", None) or heads
        self.head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // heads
        self.dtype = next(model.parameters()).dtype
        self.block_size = cfg.block_size
        self.max_blocks = -(-cfg.max_model_len // cfg.block_size) + extra_blocks
        self.kv: torch.Tensor | None = None
        n = cfg.max_num_seqs
        self.tokens = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.ctx_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.qkv: list = []  # no fused projections: cpu_decode.supported() is False, the generic path decodes
        self.last_hidden = None
        self._window: DecodeWindow | None = None

    # the native runner's fusions and graphs: nothing to do here
    def fuse(self) -> None:
        pass

    def unfuse(self) -> None:
        pass

    def drop_graphs(self) -> None:
        pass

    def begin_window(self, bs: int, steps: int) -> None:
        """Gather the rows' cached K/V once for the window's ``steps`` decode steps (:class:`~.runner.DecodeWindow`)."""
        self._window = DecodeWindow.open(self.kv, self.block_tables[:bs], self.positions[:bs], self.block_size, steps)

    def end_window(self) -> None:
        self._window = None

    def samples_in_graph(self, st) -> bool:
        return False

    # ------------------------------------------------------------------ memory
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.block_size * self.kv_heads * self.head_dim * (torch.finfo(self.dtype).bits // 8)

    def allocate_kv(self, num_blocks: int) -> None:
        shape = (self.num_layers, 2, num_blocks * self.block_size, self.kv_heads, self.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def free_kv(self) -> None:
        self.kv = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ forward
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: PagedStep, logits_index) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         logits_to_keep=logits_index, miles_step=step)
        if step.calls != self.num_layers:
            raise ConfigError(f"model '{self.model.config.model_type}': {step.calls} of its {self.num_layers} layers attended "
                              "through transformers' attention interface; the engine cannot keep the state of the others")
        return out.logits[0]

    @torch.no_grad()
    def prefill(self, input_ids, positions, slots, meta: AttnBatch, logits_index):
        """Flat prefill of chunks of several sequences -> (logits [M, V] at ``logits_index`` or None, no routing)."""
        logits = self._forward(input_ids, positions, PagedStep(self.kv, slots, self.block_size, prefill=meta), logits_index)
        return (logits if logits_index.numel() else None), None

    @torch.no_grad()
    def decode(self, bs: int, max_ctx: int, step: int = 0) -> tuple[torch.Tensor, None]:
        """One decode step of the first ``bs`` rows of the static buffers -> (logits [bs, V], no routing). Step
        ``step`` of the window :meth:`begin_window` opened (a one-step window of its own when none is open)."""
        own = self._window is None
        if own:
            self.begin_window(bs, 1)
        pos, bt, p = self.positions[:bs], self.block_tables[:bs], self.block_size
        slots = bt.gather(1, (pos // p).clamp(max=self.max_blocks - 1)[:, None])[:, 0].long() * p + pos % p
        self._window.step = 0 if own else step
        logits = self._forward(self.tokens[:bs], pos, PagedStep(self.kv, slots, p, window=self._window), 0)
        if own:
            self.end_window()
        return logits, None
