"""OpenBLAS preloading (veloxquant_mlx._blas).

Each check runs in a fresh interpreter: preloading only works before
``mlx.core`` is first imported, which pytest's own process may already have done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DEBIAN_OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")

_MATMUL_SNIPPET = r"""
import json, sys, time
import veloxquant_mlx._blas as _blas
path = _blas.preload()
import numpy as np
import mlx.core as mx

n = 1024
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
ma, mb = mx.array(a), mx.array(b)
mx.eval(ma @ mb)  # warm-up
t0 = time.perf_counter()
c = ma @ mb
mx.eval(c)
dt = time.perf_counter() - t0
ref = a.astype(np.float64) @ b.astype(np.float64)
got = np.array(c, dtype=np.float64)
print(json.dumps({
    "path": path,
    "again": _blas.preload(),
    "seconds": dt,
    "gflops": 2 * n**3 / dt / 1e9,
    "max_rel": float(np.abs(got - ref).max() / np.abs(ref).max()),
    "fro_rel": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
}))
"""


def _run(code: str, **env_overrides: str) -> dict:
    env = dict(os.environ)
    env.pop("VELOXQUANT_OPENBLAS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.update(env_overrides)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO_ROOT),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_preload_then_matmul_matches_numpy():
    res = _run(_MATMUL_SNIPPET)
    print(f"preload -> {res['path']}; 1024^2 fp32 matmul {res['seconds'] * 1e3:.1f} ms "
          f"({res['gflops']:.1f} GFLOP/s)")
    if sys.platform.startswith("linux") and DEBIAN_OPENBLAS.exists():
        assert res["path"] is not None
        assert res["again"] == res["path"]  # idempotent
    assert res["max_rel"] < 1e-4
    assert res["fro_rel"] < 1e-4


@pytest.mark.parametrize("value", ["0", "off"])
def test_env_var_disables(value):
    res = _run(
        "import json, veloxquant_mlx._blas as b; print(json.dumps({'path': b.preload()}))",
        VELOXQUANT_OPENBLAS=value,
    )
    # The package __init__ may already have called preload() with the same env.
    assert res["path"] is None


def test_too_late_after_mlx_import_is_harmless():
    res = _run(
        "import json, mlx.core, veloxquant_mlx._blas as b; "
        "print(json.dumps({'path': b.preload(), 'dtype': str(b.compute_dtype())}))"
    )
    assert res["path"] is None


def test_env_var_bad_path_falls_back_without_raising():
    res = _run(
        "import json, veloxquant_mlx._blas as b; print(json.dumps({'path': b.preload()}))",
        VELOXQUANT_OPENBLAS="/nonexistent/libopenblas.so.0",
    )
    if sys.platform.startswith("linux") and DEBIAN_OPENBLAS.exists():
        assert res["path"] == str(DEBIAN_OPENBLAS)
    else:
        assert res["path"] != "/nonexistent/libopenblas.so.0"


def test_compute_dtype_cpu_is_float32():
    import mlx.core as mx

    from veloxquant_mlx import _blas

    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert _blas.compute_dtype() == mx.float32
    finally:
        mx.set_default_device(previous)
