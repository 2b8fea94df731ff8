"""flashdora: DoRA at the cost of LoRA, as a one-line drop-in for PEFT."""

from flashdora.backend import reset_stats, stats
from flashdora.ops import dora_linear, factored_norm

__version__ = "0.1.0"

__all__ = ["factored_norm", "dora_linear", "stats", "reset_stats", "__version__"]
