"""The ``sglang`` rollout backend: SGLang-protocol HTTP servers (real SGLang or `miles serve`)."""
