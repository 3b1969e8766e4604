"""The OpenAI-compatible HTTP server: ``python -m nightjar_jax.serve --model ...``."""

from nightjar_jax.server.app import ServerSettings, build_app
from nightjar_jax.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "ServerSettings", "build_app"]
