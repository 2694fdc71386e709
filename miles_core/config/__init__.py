"""Typed configuration: each section is a dataclass beside the component that reads it."""

from miles_core.config.loader import load_config, parse_cli_args
from miles_core.config.schema import MilesConfig

__all__ = ["MilesConfig", "load_config", "parse_cli_args"]
