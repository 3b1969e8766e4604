"""nightjar-jax: a pure-JAX LLM serving engine with load-adaptive speculative decoding.

Public API (imported lazily, so ``import nightjar_jax.planner`` stays JAX-free):
``LLM``, ``SamplingParams``, ``StructuredOutputs`` (vLLM's ``StructuredOutputsParams``), ``TextPrompt``,
``TokensPrompt``, ``RequestOutputKind``, ``EngineConfig``, ``ModelConfig``, ``CacheConfig``,
``SchedulerConfig``, ``SpecConfig``, ``make_engine_config``, ``LLMEngine``, ``RequestOutput``, ``CompletionOutput``,
``BeamSearchParams``, ``EngineSleepingError``, ``make_planner`` (``StructuredOutputsParams``: vLLM's name of
``StructuredOutputs``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "nightjar_jax.engine.llm",
    "LLMEngine": "nightjar_jax.engine.engine",
    "SamplingParams": "nightjar_jax.engine.sampling_params",
    "BeamSearchParams": "nightjar_jax.engine.beam_search",
    "EngineSleepingError": "nightjar_jax.engine.engine",
    "StructuredOutputs": "nightjar_jax.engine.sampling_params",
    "StructuredOutputsParams": "nightjar_jax.engine.sampling_params",
    "RequestOutputKind": "nightjar_jax.engine.sampling_params",
    "TextPrompt": "nightjar_jax.engine.inputs",
    "TokensPrompt": "nightjar_jax.engine.inputs",
    "RequestOutput": "nightjar_jax.engine.outputs",
    "CompletionOutput": "nightjar_jax.engine.outputs",
    "EngineConfig": "nightjar_jax.config",
    "ModelConfig": "nightjar_jax.config",
    "CacheConfig": "nightjar_jax.config",
    "SchedulerConfig": "nightjar_jax.config",
    "SpecConfig": "nightjar_jax.config",
    "make_engine_config": "nightjar_jax.config",
    "make_planner": "nightjar_jax.planner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nightjar_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazily imported names too (tab completion and ``dir()`` listed none of them)."""
    return sorted(set(globals()) | set(_EXPORTS))
