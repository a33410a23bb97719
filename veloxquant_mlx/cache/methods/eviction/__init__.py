"""The eviction methods (one module each)."""
