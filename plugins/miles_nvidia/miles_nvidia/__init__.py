"""Miles on NVIDIA GPUs. Nothing here registers on import: see :mod:`miles_nvidia.plugin`."""

__version__ = "0.1.0"
