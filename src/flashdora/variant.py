"""``flashdora.peft.variant``'s old home, kept for its two classes: models ``enable``d and pickled (``torch.save``)
while the variant lived here name ``flashdora.variant.FlashDoraLinearVariant`` (or ``PeftDoraLinearVariant``, after
``disable``). Models pickled from now on name ``flashdora.peft.variant``."""

from flashdora.peft.variant import FlashDoraLinearVariant, PeftDoraLinearVariant  # noqa: F401
