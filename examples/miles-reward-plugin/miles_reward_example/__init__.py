"""Template Miles plugin (see plugin.py)."""
