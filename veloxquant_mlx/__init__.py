"""VeloxQuant-MLX: compressed KV caches for MLX language models served by mlx_lm."""

from . import _blas

_blas.preload()  # must run before mlx is first imported (Linux: use OpenBLAS, ~35x faster matmuls)

__version__ = "0.1.0"
