from flashdora.ops.linear import dora_linear
from flashdora.ops.norm import factored_norm

__all__ = ["dora_linear", "factored_norm"]
