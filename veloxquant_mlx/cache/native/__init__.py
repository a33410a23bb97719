"""CPU kernels as MLX primitives (C++, one source per kernel beside ``common.h``, bound in ``module.cpp``): what MLX's
ops cannot do fast on a CPU -- read each code once and decode it in registers -- for the decode steps of waterfill
(``waterfill_cpu.cpp``; its op path is elementwise passes over every stored row, one gather per code, the RoPE turn:
docs/RESULTS.md "CPU decode on two streams"), KIVI (``kivi_cpu.cpp``, its own layout, also behind KIVI-sink's sinks,
XQuant's shared codes, with Kitty's second key store, in age-tiered's three stores and with keys read as rows for
SKVQ and ZipCache, with GEAR's corrections applied to each decoded block, AnchorKV's anchors as such corrections
over key rows; the op path is MLX's ``quantized_matmul`` on two streams) and TurboQuant-RVQ
(``turboquant_rvq_cpu.cpp``, also NSNQuant's residual VQ with its norm pairs and channel mean, and VecInfer's
product codes, one codebook indexed by both code planes; the op path gathers from lookup tables and decodes every
value codeword), the low-rank caches' latents (``latent_cpu.cpp``:
SVDq's and KVTC's mixed-width latents, xKV's in KIVI's key layout, AMC's and AdaKV's tiers' rows on shared channel
ranges, Palu's pre-RoPE keys rebuilt per block and turned; the op path decodes every latent each step), KVQuant
(``kvquant_cpu.cpp``: non-uniform key levels through per-group tables, outliers and sinks put back, pre-RoPE keys
turned per block; also CacheGen's uniform deltas against their groups' anchors; the op path decodes the whole past),
and TurboQuant-RVQ's encoder (``turboquant_rvq_encode_cpu.cpp``: the op path's beam search as vectors, where MLX's
ops take ~10 small passes per chunk), and the end of those decode steps (``joint_finish_cpu.cpp``: the exact rows,
the sinks and the normalization joined to a kernel's partials in one primitive, where ``window.joint_attention``
takes ~25 small ops a layer; also the whole step of caches holding exact float16 rows: MiniCache's raw blocks,
A2ATS's and RocketKV's selected rows), a CPU prefill tile's softmax (``softmax_cpu.cpp``, ``attention.cpu_attention``:
MLX's CPU softmax is one libm exponential per element on one thread; there too A2ATS's retrieval vote, ``vq_vote``),
and TOVA's and MorphKV's one-row drop of a
decode step (``drop_row_cpu.cpp``, ``kernels.drop_row``: the op path's argmin and three gathers of every held row).
The batch forms' decode steps take the same kernels with per-sequence row counts and spans (``window.batch_finish``).
Vector code uses GCC/Clang vector extensions; the register-blocked products use the hardware's own width
(``common.h``'s ``vn``); value rows of 2-, 4- and 8-bit codes are decoded a vector of words at a time
(``value_lanes``).

Built on first use for the machine at hand (``build.py``: a C++ compiler, CMake and nanobind, the ``cpu`` extra),
then loaded from a per-user cache. Where the build is impossible the op path runs: silently when nanobind is not
installed (the extra is optional), else with one warning line. Each kernel is checked against the op path at its
first use in a process (``kernels.checked_call``). ``VELOXQUANT_CPU_KERNELS=0`` in the environment (read at
import) turns them off. On a GPU device they are never used (the CUDA kernels are)."""

from __future__ import annotations

import functools
import os
import warnings

import mlx.core as mx

from .build import BuildError, load

__all__ = ["available", "module", "cpu_kernels_enabled", "BuildError"]

_ENV_ON = os.environ.get("VELOXQUANT_CPU_KERNELS", "1") != "0"
_CPU = mx.Device(mx.cpu)


@functools.cache
def module():
    """The extension module, or None where it cannot be built or loaded (one warning line, unless nanobind is
    simply not installed)."""
    try:
        return load()
    except BuildError as err:
        if "nanobind is not installed" not in str(err):
            warnings.warn(f"veloxquant CPU kernels unavailable ({str(err).splitlines()[0]}); using the op path",
                          RuntimeWarning, stacklevel=2)
        return None


def cpu_kernels_enabled() -> bool:
    """True when the default device is the CPU and ``VELOXQUANT_CPU_KERNELS`` is not ``0`` (the build is tried at
    the first :func:`available`)."""
    return _ENV_ON and mx.default_device() == _CPU


def available() -> bool:
    """Whether a CPU decode step may take the kernels here: enabled, and the extension built and loaded."""
    return cpu_kernels_enabled() and module() is not None
