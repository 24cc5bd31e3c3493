"""The original's module path of `OpenaiBaseUrlAndApiKey` (ajet/compat/openai_endpoint.py)."""

from ajet.compat.openai_endpoint import OpenaiBaseUrlAndApiKey

__all__ = ["OpenaiBaseUrlAndApiKey"]
