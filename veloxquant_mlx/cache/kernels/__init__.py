"""Fused single-query (decode) attention kernels on the compressed forms, one module per storage layout: ``kivi``
(KIVI's groups and its family), ``waterfill``, ``turboquant_rvq``.

Each kernel reads every quantized token's packed codes once, dequantizes them in registers and
produces split-K partial results of an online softmax (running max ``m``, sum ``l`` and the
weighted value sum ``acc`` per query head and split of the context); one more block per KV head
takes the exact float rows the caches keep beside their codes (sinks, window or residual, the step's
own row); the launch's last block per KV head joins them in one softmax (reference: :func:`merge_partials`), or,
past ``_common.FUSED_MAX_S1`` partials, a second launch (:func:`merge_kernel`) does. GQA-aware: one block reads a
KV head's codes once for all its query heads. fp16/bf16/fp32 in, fp32 accumulation. Each kernel comes in four
variants (``_common.kernel_variants``): a single cache's, counts as scalars, or a batch form's, per-sequence
counts as an input (ragged sequences); each returning its partials or merged.

Backends: CUDA (NVRTC, ``mx.fast.precompiled_cuda_kernel``: ``_compile.py``), chosen when :func:`kernels_enabled`;
everywhere else the caches keep their op path, the reference every kernel is tested against
(``tests/test_decode_kernels.py``). The bodies are written against a small macro prelude (``_compile.py``: lane id,
shuffles, shared memory, exp), so that KIVI's float32-sum kernel and waterfill's also build for Metal through
``mx.fast.metal_kernel`` (``_compile.METAL_MACROS``; partials only, merged by the op path). That build is opt-in,
``VELOXQUANT_METAL_KERNELS=1`` (``_common.metal_enabled``): it has never run on an Apple GPU, only been parsed here
with libclang against a stand-in for Metal (``tests/test_metal_source.py``); on a Mac each kernel is checked against
the op path at first use and turned off with one warning if it fails to build or differs.

Prefill kernels share the layouts: ``waterfill_rows`` (a chunk's rows to waterfill's codes, and the stored
past back to dense rows in the model's dtype), ``kivi_rows`` (KIVI's past to dense rows) and ``turboquant_rvq_rows``
(a chunk's rows to TurboQuant-RVQ's codes, and its past to rotated-domain rows): the rows a GPU prefill chunk's
fused attention reads, in one launch each instead of dozens of small ops. Two encoding kernels serve methods without
a decode kernel: ``vq_nearest`` (VecInfer's and A2ATS's nearest-codeword search, no distance matrix) and
``power_fit`` (GEAR's subspace-iteration fit, a thread block per matrix). ``observed_decode`` serves the eviction
caches that observe their attention: a decode step's output and float32 probabilities in one launch (on Metal
opt-in like the others); ``drop_row`` the one-row drop of TOVA and MorphKV (CUDA).

``VELOXQUANT_DECODE_KERNELS=0`` in the environment (read at import) turns the kernels off (op path everywhere).
"""

from .. import dispatch, native
from ._common import (Merge, checked_call, kernels_enabled, merge_kernel, merge_partials, metal_enabled, split_count,
                      step_counters)

__all__ = ["Merge", "checked_call", "kernels_enabled", "keeps_rows", "merge_kernel", "merge_partials", "metal_enabled",
           "split_count", "step_counters"]


def keeps_rows(cache, rows: int) -> bool:
    """Whether a :class:`RowsMemo` keeps the dense rows built for a call of ``rows`` new rows: decode steps
    (one row) that go to a kernel (dispatch point installed, the CUDA or the CPU kernels on, ``attend_path``
    "auto"), whose attention never evaluates them. A prefill chunk's dense rows are evaluated by its attention:
    kept, every layer would hold its dense past until its next append."""
    return (rows == 1 and getattr(cache, "attend_path", "auto") == "auto" and dispatch.installed()
            and (kernels_enabled() or native.available()))
