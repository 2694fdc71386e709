"""Fixtures and contract checks for plugin authors, shipped as a pytest plugin (``-p miles``)."""
