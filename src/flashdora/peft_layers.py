"""``flashdora.peft.layers``'s old home, kept as re-exports: models saved whole (``torch.save``) before the move name
``FlashDoraLinear``, ``FlashDoraLinear4bit`` and ``FlashDoraLinear8bitLt`` here, and unpickling looks them up by that
name. The bitsandbytes classes are made on first use (PEP 562), so this module forwards attribute lookups too; classes
pickled from now on name ``flashdora.peft.layers``.
"""

from flashdora.peft import layers as _layers
from flashdora.peft.layers import FlashDoraLinear  # noqa: F401


def __getattr__(name: str):
    """``FlashDoraLinear4bit`` / ``FlashDoraLinear8bitLt`` (made on first use), and the rest of the old module."""
    try:
        return getattr(_layers, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
