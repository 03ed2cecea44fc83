"""The benchmark scripts (see README.md). Each runs as ``python benchmarks/x.py`` or as
``python -m benchmarks.x`` from the repository root; :mod:`benchmarks.harness` is what they
share."""
