"""Miles core: the RL post-training loop and the plugin hooks that define its parts."""

__version__ = "0.1.0"
