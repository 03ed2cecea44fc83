"""The package version: one place, read by ``bsloss.__version__``, the metric's hash and the
build (``pyproject.toml``: ``[tool.setuptools.dynamic]``)."""

__version__ = "0.1.0"
