"""Rollout engines behind one seam (:class:`Engine`). Implementations are imported lazily
by :func:`make_engine`, so importing this package does not import torch."""

from echo2.engines.base import (
    FINISH_EOS,
    FINISH_LENGTH,
    Completion,
    Engine,
    SamplingParams,
    TensorLayout,
    make_engine,
    validate_weights,
)

__all__ = [
    "FINISH_EOS",
    "FINISH_LENGTH",
    "Completion",
    "Engine",
    "SamplingParams",
    "TensorLayout",
    "make_engine",
    "validate_weights",
]
