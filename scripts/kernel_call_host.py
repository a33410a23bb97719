"""Host cost of one custom-kernel call on MLX's CUDA backend, against the size of the cubin handed over: building
the graph node (``mx.fast.precompiled_cuda_kernel`` without evaluation) and queueing it (``mx.async_eval`` of a
chain of launches), next to an elementwise op and to ``mx.fast.cuda_kernel``'s source-text form. The same tiny
kernel is passed with zero bytes appended to its cubin, so only the size differs (CUDA only).

    python scripts/kernel_call_host.py [--calls 4000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from veloxquant_mlx.cache.kernels._compile import compile_binary  # noqa: E402

_SOURCE = r"""
extern "C" __global__ void vq_double(const float* x, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 2.0f * x[i];
}
"""


def per_call(fn, calls: int, rounds: int = 5) -> float:
    """Median over rounds of the microseconds per ``fn()`` call (graph building only)."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def queued(step, chain: int, rounds: int = 20) -> float:
    """Median microseconds per launch to queue a chain of ``chain`` dependent calls of ``step`` (``mx.async_eval``),
    each chain evaluated untimed after it."""
    x = mx.ones((1024,), mx.float32)
    mx.eval(x)
    out = []
    for _ in range(rounds):
        y = x
        for _ in range(chain):
            y = step(y)
        t0 = time.perf_counter()
        mx.async_eval(y)
        out.append((time.perf_counter() - t0) / chain * 1e6)
        mx.eval(y)
    return statistics.median(out)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=4000)
    a = ap.parse_args(argv)
    cubin = compile_binary(_SOURCE, "vq_double")
    x = mx.ones((1024,), mx.float32)
    mx.eval(x)

    def launch(src, y=x):
        return mx.fast.precompiled_cuda_kernel(name="vq_double", compiled_source=src, inputs=[y],
                                               output_shapes=[(1024,)], output_dtypes=[mx.float32], scalars=[1024],
                                               grid=(1024, 1, 1), threadgroup=(256, 1, 1))[0]

    print(f"cubin {len(cubin)} bytes; {mx.default_device()}")
    print(f"elementwise op x * 2: {per_call(lambda: x * 2, a.calls):7.2f} us per call (build)")
    for pad in (0, 50_000, 100_000, 200_000):
        src = cubin + bytes(pad)
        print(f"precompiled_cuda_kernel, cubin + {pad:7d} bytes: {per_call(lambda: launch(src), a.calls):7.2f} us per "
              "call (build)")
    jit = mx.fast.cuda_kernel(name="vq_double_jit", input_names=["x"], output_names=["out"],
                              source="unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;"
                                     " if (i < 1024) out[i] = 2 * x[i];")
    jit_call = lambda y=x: jit(inputs=[y], output_shapes=[(1024,)], output_dtypes=[mx.float32],  # noqa: E731
                               grid=(1024, 1, 1), threadgroup=(256, 1, 1))[0]
    print(f"cuda_kernel (source text): {per_call(jit_call, a.calls):7.2f} us per call (build)")
    mx.eval(launch(cubin))  # loaded under its name: can a call now hand over only the name?
    try:
        mx.eval(launch(b"x"))
        by_name = True
    except RuntimeError as e:  # MLX 0.32.4 on the H200: "Binary format ... is not recognized"
        by_name = False
        print(f"a call by name (1-byte source) fails: {str(e).splitlines()[0][:120]}")
    for chain in (32, 128):
        name_part = f"; by name {queued(lambda y: launch(b'x', y), chain):6.2f}" if by_name else ""
        print(f"queue, chain of {chain}: x * 2 {queued(lambda y: y * 2, chain):6.2f} us/launch; precompiled "
              f"{queued(lambda y: launch(cubin, y), chain):6.2f}; padded +100000 "
              f"{queued(lambda y: launch(cubin + bytes(100_000), y), chain):6.2f}{name_part}; cuda_kernel "
              f"{queued(lambda y: jit_call(y), chain):6.2f}")

if __name__ == "__main__":
    main()
