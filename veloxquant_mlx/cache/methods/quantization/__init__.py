"""The quantization methods (one module each); their quality and bytes, measured by one command: docs/RESULTS.md."""
