"""Quality and speed measurement against mlx_lm's uncompressed cache."""
