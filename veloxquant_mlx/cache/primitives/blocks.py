"""Work over many rows in blocks whose temporaries never pile up.

MLX allocates an op's output when the host dispatches it, ahead of the device (the CPU's worker thread, a GPU's
stream), and frees it when the op is done; blocks left to one evaluation are dispatched together, so their
temporaries (a [rows, K] distance matrix each) live at once (and ~ten ahead even when queued one by one). Each block
is queued as it is built (``mx.async_eval``); the host waits (``wait_for``) for the block ``IN_FLIGHT`` back and
for the last one: a call's blocks then hold at most ``IN_FLIGHT + 1`` blocks' temporaries, and none beside the
layer's attention that follows. A call of one block (a decode step) is left lazy. The same on a GPU, with larger
blocks (fewer launches): there, left unwaited, 2^24-entry blocks held 1.2-6.9x the plain cache's prefill peak
(RESULTS.md, session 34); a GPU's block is also a bounded share of its call (``block_entries(total)``), so a small
model's blocks stay small.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

#: float32 temporary entries per block: small on the CPU, larger on a GPU (fewer launches). On an H100, SmolLM2's
#: prompt in one chunk peaked at 1.2-6.9x the plain cache's with 2^24-entry blocks never waited for (vecinfer,
#: a2ats, nsnquant, the attention-weight eviction methods), at 0.4-0.9x with 2^22 waited for as on the CPU
#: (``scripts/device_policy_variants.py``, RESULTS.md)
BLOCK_ENTRIES_CPU, BLOCK_ENTRIES_GPU = 1 << 18, 1 << 22
#: on a GPU a block also holds at most 1/GPU_BLOCK_SHARE of its call's whole temporaries (never under the CPU's
#: size): a small model's call made three 2^22-entry blocks of distances, above the plain cache's whole prefill peak
#: (vecinfer on a tiny llama, an H100: 2.2-3.0x), while a large call keeps 2^22 (fewer host waits)
GPU_BLOCK_SHARE = 16
IN_FLIGHT = 2  # blocks a multi-block call keeps queued beyond the one the host waits for


def on_cpu() -> bool:
    """Whether the default device is the CPU (block sizes here and query tiles in ``attention`` differ on a GPU)."""
    return mx.default_device() == mx.cpu


def block_entries(total: int | None = None) -> int:
    """Temporary entries one block may make on the default device, for a call of ``total`` entries in all (if
    known: on a GPU a block is at most ``1 / GPU_BLOCK_SHARE`` of them, and at least the CPU's block)."""
    if on_cpu():
        return BLOCK_ENTRIES_CPU
    if total is None:
        return BLOCK_ENTRIES_GPU
    return min(BLOCK_ENTRIES_GPU, max(BLOCK_ENTRIES_CPU, int(total) // GPU_BLOCK_SHARE))


def wait_for(arrays: list) -> None:
    """The bounded host wait of ``queued_row_blocks`` and ``settle_prefill`` (the prefill sync test stubs it, as it
    does the contract's ``queue_chunk_check``)."""
    mx.eval(arrays)


def settle_prefill(n_rows: int, held: Callable[[], list]) -> None:
    """A cache's ``_store`` of ``n_rows`` rows: a prefill call (``n_rows > 1``) waits for ``held()`` (the layer's
    codes and fits) before the layer's attention is queued, so no layer's rows and fit temporaries live to the
    chunk's end; a decode step never waits (nor builds the list)."""
    if n_rows > 1:
        wait_for(held())


def queued_row_blocks(fn: Callable[[int, int], object], n: int, rows: int) -> list:
    """``[fn(a, b) for each block [a, b) of range(n)]``, ``rows`` at a time; with more than one block each result
    (an array or a tuple of arrays and None) is queued as it is built and waited for as the module says."""
    rows = max(1, int(rows))
    if n <= rows:
        return [fn(0, n)]
    outs, arrays = [], []
    for a in range(0, n, rows):
        out = fn(a, min(a + rows, n))
        arrays.append([o for o in (out if isinstance(out, tuple) else (out,)) if o is not None])
        mx.async_eval(arrays[-1])
        if len(arrays) > IN_FLIGHT:
            wait_for(arrays[-1 - IN_FLIGHT])
        outs.append(out)
    wait_for(arrays[-1])  # the last blocks' temporaries are gone before what follows (the layer's attention)
    return outs
