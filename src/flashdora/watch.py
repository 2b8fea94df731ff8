"""``flashdora.peft.watch``'s old home, kept for one name: every model ``enable``d before the move holds
``_loaded`` as a ``load_state_dict`` post-hook of its LoRA layers, so its pickle (``torch.save``) names
``flashdora.watch._loaded``. Models pickled from now on name ``flashdora.peft.watch``."""

from flashdora.peft.watch import _loaded  # noqa: F401
