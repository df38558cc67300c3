"""Built-in models: the character tokenizer and the tiny transformer, plus the shipped
warm-started checkpoint (``assets/tiny_addition``).

The torch-backed names are imported lazily so that torch-free users of the tokenizer (the
simulated engine, task code) do not pay for importing torch.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.models.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from echo2.models.tiny import KVCache, TinyConfig, TinyTransformer

WARM_START_NAME = "tiny_addition"
_LAZY = {"KVCache", "TinyConfig", "TinyTransformer"}


def default_checkpoint_dir() -> Path:
    """Directory of the shipped warm-started tiny-addition checkpoint."""
    return Path(str(resources.files("echo2.models") / "assets" / WARM_START_NAME))


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from echo2.models import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CharTokenizer", "KVCache", "TinyConfig", "TinyTransformer", "default_checkpoint_dir"]
