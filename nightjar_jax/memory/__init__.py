"""Memory: the elastic manager's policy (draft offload / reload; host side, no JAX). The device moves it asks for
live in ``nightjar_jax.engine.runner.ModelRunner`` (``offload_draft`` / ``reload_draft``)."""

from nightjar_jax.memory.elastic import DraftPlacement, ElasticPolicy, MemoryAction, PoolState

__all__ = ["DraftPlacement", "ElasticPolicy", "MemoryAction", "PoolState"]
