"""bitsandbytes: a quantized base layer's result and its dequantized weight (QDoRA)."""
