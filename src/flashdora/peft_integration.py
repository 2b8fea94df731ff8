"""The PEFT seam's old home, kept as re-exports: models saved whole (``torch.save``) before the seam moved to
``flashdora.peft`` name their classes here (``FlashDoraLinearVariant``, ``PeftDoraLinearVariant``, the
``FlashDoraCounting*`` variants, ``FlashDoraLinear``), and unpickling looks them up by that name. The code lives in
``flashdora.peft.switch`` (``enable``, ``disable``, ``patch_peft``, ``unpatch_peft``), ``flashdora.peft.variant`` and
``flashdora.peft.layers``; classes pickled from now on name those modules.
"""

from flashdora.peft import switch as _switch
from flashdora.peft.layers import FlashDoraLinear  # noqa: F401 - its home before peft_layers
from flashdora.peft.switch import disable, enable, layer_path, patch_peft, unpatch_peft  # noqa: F401
from flashdora.peft.variant import (  # noqa: F401
    DROPOUT_MODES,
    FlashDoraLinearVariant,
    PeftDoraLinearVariant,
    dropout_mode,
    flash_forward,
    is_patched,
)


def __getattr__(name: str):
    """Anything else of the seam's old surface, e.g. the ``FlashDoraCounting*`` variants made at import in
    ``flashdora.peft.switch``."""
    try:
        return getattr(_switch, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
