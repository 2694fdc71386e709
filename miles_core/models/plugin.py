from miles_core.hookspecs import hookimpl
from miles_core.models.base import ModelFamily
from miles_core.models.decoder import Decoder
from miles_core.models.moe import MoeDecoder, MoeFamily
from miles_core.plugins.registry import Registry


@hookimpl
def miles_register_model_families(registry: Registry) -> None:
    registry.add("llama", ModelFamily("llama", ("llama",), "LlamaForCausalLM", False, Decoder))
    registry.add("qwen3", ModelFamily("qwen3", ("qwen3",), "Qwen3ForCausalLM", True, Decoder))
    registry.add("qwen3_moe", MoeFamily("qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", True, MoeDecoder))
