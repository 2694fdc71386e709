"""The Megatron trainer backend (megatron-core). Nothing here imports megatron at module level
except the files that build or run the model; the plugin imports them inside its factory."""
