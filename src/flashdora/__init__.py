"""flashdora: DoRA at the cost of LoRA, as a one-line drop-in for PEFT.

import flashdora
flashdora.enable(peft_model)   # or flashdora.patch_peft() before building the model
"""

from flashdora.backend import reset_stats, stats
from flashdora.ops import dora_linear, factored_norm
from flashdora.ops.norm_cache import invalidate
from flashdora.peft_integration import disable, enable, patch_peft, unpatch_peft
from flashdora.report import report

__version__ = "0.1.0"

__all__ = [
    "factored_norm",
    "dora_linear",
    "enable",
    "disable",
    "patch_peft",
    "unpatch_peft",
    "stats",
    "reset_stats",
    "report",
    "invalidate",
    "__version__",
]
