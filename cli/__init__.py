"""The `miles` command line (installed as the package miles_cli)."""
