"""Budgets that hold while generating (issue 14, part 5): the ``decode_evict`` option.

* memory: stored rows stay within ``budget + slack`` at every decode step (10,000 steps on a tiny
  llama for SnapKV's decode-time extension; a few hundred for every other eviction method), and MLX's
  active memory stops growing;
* decisions: the rows SnapKV keeps at a decode-time eviction are the top ones of a float64 reference
  of its rule (ring of the last W real queries, softmax votes, pooling, protected sinks/window);
* option semantics: off keeps every decode row, on evicts in blocks (one top-k per ``slack`` steps);
  bad values raise ``QuantizerConfigError``; trim and state stay correct.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import mlx.core as mx
import pytest

from tests.tiny_models import tiny_llama
from veloxquant_mlx.cache import dispatch
from veloxquant_mlx.cache import options as opt
from veloxquant_mlx.cache.config import KVCacheConfig
from veloxquant_mlx.cache.errors import QuantizerConfigError
from veloxquant_mlx.cache.factory import KVCacheBuilder, KVCacheFactory

BUDGET = 32


def _config(method: str, budget: int = BUDGET, **extra) -> KVCacheConfig:
    """``method`` with a budget of ``budget`` rows (sinks kept small so the budget is valid)."""
    o = {
        "snapkv": lambda: opt.SnapKVOptions(budget=budget, obs_window=8, n_sink=2),
        "h2o": lambda: opt.H2OOptions(budget=budget, n_sink=2, grace=4),
        "tova": lambda: opt.TOVAOptions(budget=budget, n_sink=2),
        "pyramidkv": lambda: opt.PyramidKVOptions(budget=budget + 32, n_sink=2),
        "chunkkv": lambda: opt.ChunkKVOptions(budget=budget + 32, n_sink=2),
        "cam": lambda: opt.CaMOptions(budget=budget + 32, n_sink=2),
        "knorm": lambda: opt.KNormOptions(budget=budget, n_sink=2, recent=4),
        "keyformer": lambda: opt.KeyformerOptions(budget=budget, n_sink=2, recent=4),
        "morphkv": lambda: opt.MorphKVOptions(budget=budget, n_sink=2, window=4),
        "kvzip": lambda: opt.KVzipOptions(budget=budget, n_sink=2),
        "curdkv": lambda: opt.CurDKVOptions(budget=budget, n_sink=2),
        "nestedkv": lambda: opt.NestedKVOptions(budget=budget, n_sink=2, window=4),
        "qfilters": lambda: opt.QFiltersOptions(budget=budget, n_sink=2, recent=4, calib_tokens=16,
                                            on_low_retention="ignore"),
    }[method]()
    return KVCacheConfig(method=method, options=o, **extra)


def _bound(cache) -> int:
    """Most rows a cache may hold between decode steps: its budget plus its eviction slack."""
    slack = getattr(cache, "evict_slack", None)
    if slack is None:
        slack = getattr(cache, "slack", 0)
    return cache.budget + slack


def _caches(model, config, decode_evict):
    caches = KVCacheBuilder.for_model(model, config)
    for c in caches:
        # the per-cache setting; ``KVCacheConfig.decode_evict`` sets it for every layer once the
        # config carries the field (the caches read it with getattr until then)
        c.decode_evict = decode_evict
    return caches


def _decode(model, caches, prompt_len: int, steps: int, seed: int = 0, on_step=None):
    mx.random.seed(seed)
    prompt = mx.random.randint(0, 128, (1, prompt_len))
    tok = model(prompt, cache=caches)[:, -1].argmax(-1)
    mx.eval(tok)
    for i in range(steps):
        tok = model(tok[:, None], cache=caches)[:, -1].argmax(-1)
        mx.eval(tok)
        if on_step is not None:
            on_step(i)


# ------------------------------------------------------------------ memory flat
def test_snapkv_rows_and_active_memory_flat_over_10000_decode_steps():
    model = tiny_llama(n_layers=1)
    caches = _caches(model, _config("snapkv"), True)
    c = caches[0]
    bound = _bound(c)
    assert bound == BUDGET + max(8, BUDGET // 8)
    worst, samples, nbytes = [0], [], set()

    def check(i):
        worst[0] = max(worst[0], c.rows)  # a Python int: reading it syncs nothing
        if i >= 1000 and i % 1000 == 0:
            samples.append(mx.get_active_memory())
            nbytes.add(c.nbytes)

    _decode(model, caches, 48, 10_000, on_step=check)
    assert c.offset == 48 + 10_000
    assert worst[0] <= bound
    assert len(nbytes) == 1  # buffers of budget + slack + 1 rows, reused between evictions
    # Without decode eviction every step adds one K and one V row per KV head (fp16): 9,000 steps
    # would add that many bytes; memory must not grow by even a tenth of it.
    H, D = c.keys.shape[1], c.keys.shape[3]
    growth_without = 9_000 * H * 2 * D * 2
    assert max(samples) - samples[0] < growth_without / 10, samples


DECODE_METHODS = ["snapkv", "h2o", "tova", "pyramidkv", "chunkkv", "cam", "knorm", "keyformer", "morphkv",
                  "kvzip", "curdkv", "nestedkv", "qfilters"]


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_budget_holds_at_every_decode_step(method):
    model = tiny_llama(n_layers=2)
    caches = _caches(model, _config(method), True)
    steps = 3 * (max(_bound(c) for c in caches) + 1)
    worst = [0] * len(caches)

    def check(i):
        for j, c in enumerate(caches):
            worst[j] = max(worst[j], c.rows)

    _decode(model, caches, 80, steps, on_step=check)
    for c, w in zip(caches, worst):
        assert c.offset == 80 + steps
        assert w <= _bound(c), (method, w, c.budget)
        # and it does not evict far below its budget (ChunkKV keeps whole chunks)
        assert c.rows >= c.budget - getattr(c, "chunk_size", 1)


@pytest.mark.parametrize("method", ["h2o", "tova", "pyramidkv", "snapkv"])
def test_decode_evict_off_keeps_every_decode_row(method):
    model = tiny_llama(n_layers=1)
    caches = _caches(model, _config(method), False)
    _decode(model, caches, 80, 60)
    c = caches[0]
    assert c.rows == c.budget + 60  # the prompt was cut to the budget, decode rows all stay
    pos = np.array(c.positions[0, 0, : c.rows])
    assert (pos[-60:] == np.arange(81, 81 + 60) - 1).all()


def test_method_defaults_follow_the_papers():
    # H2O and TOVA evict while decoding by design; SnapKV compresses the prompt only
    assert KVCacheFactory.create(_config("h2o")).decode_evict is True
    assert KVCacheFactory.create(_config("tova")).decode_evict is True
    assert KVCacheFactory.create(_config("snapkv")).decode_evict is False


def test_snapkv_evicts_in_blocks(monkeypatch):
    model = tiny_llama(n_layers=1)
    caches = _caches(model, _config("snapkv"), True)
    c = caches[0]
    calls = []
    orig = type(c).evict
    monkeypatch.setattr(type(c), "evict", lambda self, *a, **k: (calls.append(self.rows), orig(self, *a, **k))[1])
    _decode(model, caches, 48, 200)
    slack = c.evict_slack
    # one prefill eviction, then one top-k per slack + 1 decode steps, each at budget + slack + 1 rows
    assert calls[0] == 48
    assert all(r == BUDGET + slack + 1 for r in calls[1:])
    assert len(calls) - 1 == (200 - (BUDGET + slack + 1 - BUDGET)) // (slack + 1) + 1


def test_bad_decode_evict_value_is_a_config_error():
    c = KVCacheFactory.create(_config("snapkv"))
    with pytest.raises(QuantizerConfigError, match="decode_evict"):
        c.decode_evict = "yes"


# ------------------------------------------------------------------ decisions vs a float64 reference
def _pool7(x):
    pad = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(3, 3)])
    return np.stack([pad[..., i : i + x.shape[-1]] for i in range(7)]).mean(0)


def _ref_snapkv_scores(q, qpos, keys, kpos, scale, n_sink, recent, offset):
    """float64 SnapKV rule: q [Hq, W, D] with positions qpos [W] (-1 empty), keys [H, M, D] with
    positions kpos [H, M]. Returns scores [H, M] (pooled votes; inf on protected rows)."""
    H, M, _ = keys.shape
    rep = q.shape[0] // H
    votes = np.zeros((H, M))
    for h in range(H):
        for r in range(rep):
            logits = (q[h * rep + r] @ keys[h].T) * scale  # [W, M]
            vis = kpos[h][None, :] <= qpos[:, None]
            logits = np.where(vis, logits, -np.inf)
            for w in range(q.shape[1]):
                if vis[w].any():
                    p = np.exp(logits[w] - logits[w].max())
                    votes[h] += np.where(vis[w], p / p.sum(), 0.0)
    scores = _pool7(votes)
    protected = (kpos < n_sink) | (kpos >= offset - recent)
    scores = np.where(protected, np.inf, scores)
    return scores


def test_snapkv_decode_eviction_keeps_the_reference_top_rows():
    dispatch.install()
    rng = np.random.default_rng(3)
    H, Hq, D, W = 2, 4, 16, 8
    cfg = _config("snapkv", budget=24, dtype=mx.float32)
    c = KVCacheFactory.create(cfg)
    c.decode_evict = True
    scale = D ** -0.5

    def step(n):
        q = mx.array(rng.standard_normal((1, Hq, n, D)).astype(np.float32))
        k = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float32))
        ks, vs = c.update_and_fetch(k, v)
        out = c.attend(q, ks, vs, scale=scale, mask="causal" if n > 1 else None)
        mx.eval(out, c.keys, c.positions)
        return q

    step(40)  # prefill: cut to 24
    assert c.rows == 24
    seen_q = []
    while True:  # decode until the step that evicts
        before_keys = np.array(c.keys[0, :, : c.rows], dtype=np.float64)
        before_pos = np.array(c.positions[0, :, : c.rows])
        ring_q = np.array(c.qring[0], dtype=np.float64) if c.qring is not None else None
        ring_pos = np.array(c.qring_pos) if c.qring_pos is not None else None
        offset = c.offset
        q = step(1)
        seen_q.append(q)
        if c.rows == 24:
            break
    # the ring the eviction used: the one before this step plus this step's query at slot offset % W
    slot = offset % W
    ring_q[:, slot] = np.array(q[0, :, 0], dtype=np.float64)
    ring_pos[slot] = offset
    kept_pos = np.array(c.positions[0, :, : c.rows])
    assert (kept_pos[:, -W:] == np.arange(offset + 1 - W, offset + 1)).all()  # recent window kept
    # the rows before eviction: those before the step plus the new one (kept: it is in the window)
    new_key = np.array(c.keys[0, :, c.rows - 1], dtype=np.float64)[:, None]
    keys = np.concatenate([before_keys, new_key], axis=1)
    kpos = np.concatenate([before_pos, np.full((H, 1), offset)], axis=1)
    scores = _ref_snapkv_scores(ring_q, ring_pos, keys, kpos, scale, n_sink=2, recent=W, offset=offset + 1)
    for h in range(H):
        order = np.sort(scores[h])[::-1]
        t = (order[23] + order[24]) / 2  # between the 24th and 25th best
        # float32 vs float64: decisions within a band of a few float32 ulps of the votes may differ
        tol = 1e-4 * np.abs(scores[h][np.isfinite(scores[h])]).max()
        got = set(kept_pos[h].tolist())
        assert set(kpos[h][scores[h] > t + tol].tolist()) <= got, h
        assert not (set(kpos[h][scores[h] < t - tol].tolist()) & got), h
    assert len(seen_q) == c.evict_slack + 1  # the first eviction came after slack + 1 decode steps


# ------------------------------------------------------------------ trim and state
def test_snapkv_decode_evict_trim_and_state_round_trip():
    model = tiny_llama(n_layers=1)
    caches = _caches(model, _config("snapkv"), True)
    _decode(model, caches, 48, 100)
    c = caches[0]
    from veloxquant_mlx.cache.methods.eviction.snapkv import SnapKVKVCache

    d = SnapKVKVCache.from_state(c.state)
    assert d.decode_evict is True and d.rows == c.rows and d.offset == c.offset
    assert np.array_equal(np.array(d.positions[..., : d.rows]), np.array(c.positions[..., : c.rows]))
    assert np.array_equal(np.array(d.qring_pos), np.array(c.qring_pos))
    assert c.nbytes == sum(a.nbytes for a in (c.keys, c.values, c.positions, c.qring, c.qring_pos))

    rows, off = c.rows, c.offset
    assert c.trim(3) == 3
    assert c.rows == rows - 3 and c.offset == off - 3
    assert int(mx.max(c.positions[..., : c.rows]).item()) == c.offset - 1
    assert int(mx.max(c.qring_pos).item()) == c.offset - 1  # trimmed queries no longer vote
    # decoding on after the trim still holds the budget
    worst = [0]
    tok = mx.array([1])
    for _ in range(2 * (c.evict_slack + 1)):
        tok = model(tok[:, None], cache=caches)[:, -1].argmax(-1)
        mx.eval(tok)
        worst[0] = max(worst[0], c.rows)
    assert worst[0] <= _bound(c)


def test_decode_evict_is_read_from_the_config():
    # ``KVCacheConfig.decode_evict`` (None / True / False): the caches read it with getattr, so this
    # holds before and after the field is declared on the dataclass
    cfg = _config("snapkv")
    object.__setattr__(cfg, "decode_evict", True)
    assert KVCacheFactory.create(cfg).decode_evict is True
    cfg = _config("h2o")
    object.__setattr__(cfg, "decode_evict", False)
    c = KVCacheFactory.create(cfg)
    assert c.decode_evict is False
    c.decode_evict = True  # the cache's own setting wins
    assert c.decode_evict is True
    object.__setattr__(cfg, "decode_evict", "on")
    with pytest.raises(QuantizerConfigError, match="decode_evict.*None .the method's default., True or False"):
        KVCacheFactory.create(cfg)


# ------------------------------------------------------------------ the options field and --set
def test_decode_evict_option_sets_every_layer_without_a_config_field():
    import dataclasses

    assert "decode_evict" not in {f.name for f in dataclasses.fields(KVCacheConfig)}  # the spec's signature
    model = tiny_llama(n_layers=2)
    on = KVCacheConfig(method="snapkv", options=opt.SnapKVOptions(budget=BUDGET, obs_window=8, n_sink=2,
                                                                  decode_evict=True))
    caches = KVCacheBuilder.for_model(model, on)
    assert [c.decode_evict for c in caches] == [True, True]  # snapkv's own default is False
    worst = [0]
    _decode(model, caches, 48, 3 * (caches[0].evict_slack + 1),
            on_step=lambda i: worst.__setitem__(0, max(worst[0], max(c.rows for c in caches))))
    assert worst[0] <= _bound(caches[0])  # the option really holds the budget while decoding
    off = _config("h2o").options
    off = opt.H2OOptions(**{**dataclasses.asdict(off), "decode_evict": False})
    assert KVCacheFactory.create(KVCacheConfig(method="h2o", options=off)).decode_evict is False
    assert KVCacheFactory.create(_config("h2o")).decode_evict is True  # unset: the paper's default
    for bad in ("yes", 1, 0.0):
        with pytest.raises(QuantizerConfigError, match="decode_evict.*None .the method's default., True or False"):
            opt.TOVAOptions(decode_evict=bad)
    with pytest.raises(TypeError, match="decode_evict"):  # quantizers have no such option
        opt.KIVIOptions(decode_evict=True)


def test_decode_evict_option_survives_state_and_saved_caches(tmp_path):
    from veloxquant_mlx.cache import load_cache, save_cache
    from veloxquant_mlx.cache.methods.eviction.snapkv import SnapKVKVCache

    model = tiny_llama(n_layers=2)
    cfg = KVCacheConfig(method="snapkv", options=opt.SnapKVOptions(budget=BUDGET, obs_window=8, n_sink=2,
                                                                   decode_evict=True))
    caches = KVCacheBuilder.for_model(model, cfg)
    tokens = list(range(1, 49))
    mx.eval(model(mx.array([tokens]), cache=caches))
    assert SnapKVKVCache.from_state(caches[0].state).decode_evict is True
    path = tmp_path / "snap.vqc"
    save_cache(path, caches, model_id="tiny-llama", tokens=tokens, method="snapkv")
    loaded, _ = load_cache(path, model=model, expect_method="snapkv", expect_model_id="tiny-llama")
    assert [c.decode_evict for c in loaded] == [True, True]
    assert [c.rows for c in loaded] == [c.rows for c in caches]


def test_decode_evict_on_the_command_line(capsys):
    from veloxquant_mlx import cli

    _, cfg = cli.method_config("snapkv", ["budget=64", "decode_evict=true"])
    assert isinstance(cfg.options, opt.SnapKVOptions) and cfg.options.decode_evict is True
    assert cfg.snap_budget == 64 and KVCacheFactory.create(cfg).decode_evict is True
    _, cfg = cli.method_config("h2o", ["decode_evict=false"])
    assert KVCacheFactory.create(cfg).decode_evict is False
    _, cfg = cli.method_config("snapkv", ["budget=64"])
    assert cfg.options.decode_evict is None and KVCacheFactory.create(cfg).decode_evict is False
    with pytest.raises(QuantizerConfigError, match="decode_evict"):
        cli.method_config("tova", ["decode_evict=3"])
    # a quantizer refuses it, naming the methods that have it
    with pytest.raises(cli.UsageError, match="method 'kivi' has no setting 'decode_evict'.*a setting of snapkv"):
        cli.method_config("kivi", ["decode_evict=true"])
    assert cli.main(["generate", "--prompt", "hi", "--method", "waterfill", "--set", "decode_evict=true"]) == 2
    assert "method 'waterfill' has no setting 'decode_evict'" in capsys.readouterr().err
    # `veloxquant methods snapkv` lists it with its type, default and allowed values
    row = next(r for r in cli.method_settings("snapkv") if r["name"] == "decode_evict")
    assert row == {"name": "decode_evict", "flat": "decode_evict", "kind": "option", "type": "Optional[bool]",
                   "default": None, "allowed": "None (the method's default), True or False"}
    assert not any(r["name"] == "decode_evict" for r in cli.method_settings("kivi"))


_EVICTION_METHODS = [m for m, (fam, proto, _) in __import__("veloxquant_mlx.cache.base", fromlist=["_METHOD_TABLE"])
                     ._METHOD_TABLE.items() if fam == "eviction" and proto == "mlx_lm"]


@pytest.mark.parametrize("method", _EVICTION_METHODS)
def test_every_eviction_cache_keeps_its_decode_evict_setting_in_state(method):
    """A cache's own ``decode_evict`` (flipped from its default) comes back from its state (keyformer's
    state once left it out)."""
    from veloxquant_mlx.cache.base import method_info

    options = opt.OPTIONS_BY_METHOD.get(method)
    assert method_info(method).cls is not None
    assert options is None or "decode_evict" in [f.name for f in dataclasses.fields(options)], method
    model = tiny_llama(n_layers=1)
    c = KVCacheBuilder.for_model(model, KVCacheConfig(method=method))[0]
    flipped = not c.decode_evict
    c.decode_evict = flipped
    mx.eval(model(mx.array([list(range(1, 41))]), cache=[c]))
    assert type(c).from_state(c.state).decode_evict is flipped, method
