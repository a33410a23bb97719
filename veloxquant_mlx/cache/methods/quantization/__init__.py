"""The quantization methods (one module each)."""
