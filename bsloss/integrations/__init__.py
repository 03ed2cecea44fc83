"""Integrations with other libraries' trainers: :mod:`bsloss.integrations.huggingface`."""
