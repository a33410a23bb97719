"""Compressed caches on a model sharded across 2 processes with MLX's own engine (issue 14, part 4).

``mlx.launch --backend ring -n 2`` starts two ranks over loopback; each runs tests/distributed_worker.py:
a tiny llama sharded with mlx_lm's ``model.shard`` (each rank: half the query and KV heads) and caches
from ``KVCacheBuilder.for_model`` (kivi, waterfill, snapkv), compared with the same model unsharded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from veloxquant_mlx.cache.errors import QuantizerConfigError

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("kivi", "waterfill", "snapkv")


def _launcher() -> list:
    """``mlx.launch``: the script pip installs beside the interpreter, else on PATH, else (an installation without
    scripts, e.g. ``pip install --target``) its entry point run by this interpreter."""
    exe = Path(sys.executable).with_name("mlx.launch")
    found = str(exe) if exe.exists() else shutil.which("mlx.launch")
    if found:
        return [found]
    try:
        from mlx._distributed_utils.launch import main  # noqa: F401 - where the script's entry point lives
    except ImportError:
        return []
    return [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]


def _env() -> dict:
    """This environment with the repository first on PYTHONPATH (an existing PYTHONPATH kept after it)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    launch = _launcher()
    assert launch, "mlx.launch (installed with mlx) not found"
    env = _env()
    port = random.Random(os.getpid()).randrange(20000, 60000)  # ring ports: port, port + 1
    cmd = [*launch, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--python", sys.executable,
           str(ROOT / "tests" / "distributed_worker.py"), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = []
    for r in range(2):
        res.append((json.loads((out / f"rank{r}.json").read_text()), np.load(out / f"rank{r}.npz")))
    return res


def test_each_rank_holds_half_the_kv_heads(ranks):
    for meta, _ in ranks:
        assert meta["size"] == 2
        assert meta["kv_heads_full"] == [2, 2] and meta["kv_heads_rank"] == [1, 1]


@pytest.mark.parametrize("method", METHODS)
def test_sharded_generation_matches_one_process(ranks, method):
    for meta, arrays in ranks:
        ref = arrays[f"{method}_ref_logits"]
        got = arrays[f"{method}_logits"]
        tokens = arrays[f"{method}_tokens"]
        # Sharding only reorders float32 sums (two partial all-sums); allow 1e-3 of the logits' range. A quantizing
        # cache may round a row that moved in its last bits to the neighbouring code (seen for kivi on an H200,
        # whose one- and two-head matmuls sum in other orders): allow a quarter of what compression itself moves
        # the logits (against mlx_lm's plain cache on the same tokens), far below a wrong head or row.
        moved = float(np.abs(ref - arrays[f"{method}_plain_logits"]).max())
        noise = 1e-3 * float(np.abs(ref).max())
        diff = float(np.abs(got - ref).max())
        assert diff <= max(noise, 0.25 * moved), (method, diff, noise, moved)
        # Greedy decisions: the sharded argmax is the single-process token wherever the top-2 margin
        # is beyond the difference (every step but near-ties, which float order may break either way).
        margin = np.diff(np.sort(ref, axis=-1)[:, -2:], axis=-1)[:, 0]
        assert (margin > 2 * noise).mean() >= 0.8
        decisive = margin > 2 * max(noise, diff)
        assert (arrays[f"{method}_argmax"][:-1] == tokens[64:])[decisive[:-1]].all()
    # both ranks compute the same logits (the all-sums return the same result everywhere)
    a, b = ranks[0][1][f"{method}_logits"], ranks[1][1][f"{method}_logits"]
    assert np.abs(a - b).max() <= 1e-3 * float(np.abs(a).max())


@pytest.mark.parametrize("method", METHODS)
def test_each_rank_nbytes_is_half(ranks, method):
    meta = ranks[0][0]
    m = meta[method]
    all_ranks = np.array(meta["all_rank_nbytes"])[:, METHODS.index(method)]
    assert (all_ranks == m["rank_nbytes"]).all()  # every rank holds the same
    # Bytes that scale with KV heads halve exactly; head-independent ones (waterfill's RoPE angle table,
    # its value rotation for a non-power-of-two dim) are held whole by every rank.
    assert m["rank_constant_nbytes"] == m["ref_constant_nbytes"]
    c = m["ref_constant_nbytes"]
    assert 2 * (m["rank_nbytes"] - c) == m["ref_nbytes"] - c
    if method != "waterfill":
        assert c == 0 and 2 * m["rank_nbytes"] == m["ref_nbytes"]


def test_shard_model_rejects_uneven_heads():
    import mlx.core as mx
    from tests.tiny_models import tiny_llama
    from veloxquant_mlx.distributed import shard_model

    class Group:  # a 3-rank group: 4 query / 2 KV heads do not divide
        def size(self):
            return 3

    with pytest.raises(QuantizerConfigError, match="n_heads.*multiple of the distributed group size 3"):
        shard_model(tiny_llama(n_layers=1), Group())
    assert shard_model(tiny_llama(n_layers=1), mx.distributed.init()) is not None  # size 1: unchanged


# ------------------------------------------------------------------ ``veloxquant generate`` under mlx.launch
GEN_ARGS = ["generate", "--method", "kivi", "--prompt", "Name a color.", "--max-tokens", "8", "--json"]


class _FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.mark.real_model
def test_generate_shards_the_model_and_prints_on_rank_0_only(capsys, monkeypatch):
    """The hook: with a group of 2 the CLI shards the loaded model with ``shard_model`` before building
    its caches; rank 1 prints nothing, rank 0 the usual JSON plus ``ranks``."""
    from veloxquant_mlx import cli, distributed

    calls = []
    monkeypatch.setattr(distributed, "shard_model", lambda model, group: calls.append((model, group.size())))
    monkeypatch.setattr(distributed, "init_group", lambda: _FakeGroup(1, 2))
    assert cli.main(GEN_ARGS) == 0
    out, err = capsys.readouterr()
    assert out == "" and err == "" and len(calls) == 1 and calls[0][1] == 2
    monkeypatch.setattr(distributed, "init_group", lambda: _FakeGroup(0, 2))
    assert cli.main(GEN_ARGS) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ranks"] == 2 and res["generated_tokens"] == 8 and len(calls) == 2
    monkeypatch.setattr(distributed, "init_group", lambda: _FakeGroup(0, 1))
    assert cli.main(GEN_ARGS) == 0
    assert "ranks" not in json.loads(capsys.readouterr().out) and len(calls) == 2  # one process: no shard


@pytest.mark.real_model
def test_generate_under_mlx_launch_matches_one_process():
    """``mlx.launch --backend ring -n 3 -- -m veloxquant_mlx generate ...`` on the embedded SmolLM2-135M
    (9 query / 3 KV heads: one KV head per rank): one JSON line (rank 0), the same greedy text as one
    process, and rank 0's cache holds a third of the single-process bytes (~50 s on a 2-core CPU)."""
    from veloxquant_mlx.assets import smollm2_gguf_path

    smollm2_gguf_path()  # fetched here, in this process, before the subprocesses need it
    env = _env()
    one = subprocess.run([sys.executable, "-m", "veloxquant_mlx", *GEN_ARGS], env=env, capture_output=True,
                         text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-2000:]
    ref = json.loads(one.stdout)
    port = random.Random(os.getpid() + 1).randrange(20000, 60000)
    cmd = [*_launcher(), "--backend", "ring", "-n", "3", "--starting-port", str(port), "--python", sys.executable,
           "--", "-m", "veloxquant_mlx", *GEN_ARGS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]  # rank 0 alone prints
    res = json.loads(lines[0])
    assert res["ranks"] == 3 and res["text"] == ref["text"] and res["kv_tokens"] == ref["kv_tokens"]
    assert 3 * res["kv_bytes"] == ref["kv_bytes"] and 3 * res["kv_bytes_fp16"] == ref["kv_bytes_fp16"]
