"""The cross-layer methods (one module each)."""
