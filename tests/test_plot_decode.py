"""scripts/plot_decode.py: the pooling of bench rows (rate chosen, runs pooled, per-repeat ratios to plain) and the
figure it writes."""

import json

import pytest

from scripts_util import load_script


def _module():
    return load_script("plot_decode")


def _row(label, context, steady, decode, ratio=None):
    stat = lambda m, lo, hi: {"median": m, "min": lo, "max": hi}  # noqa: E731
    r = {"label": label, "context": context, "available": True, "decode_tps": stat(*decode)}
    if steady:
        r["steady_tps"] = stat(*steady)
    if ratio:
        r["paired_ratios"] = {"none": {"steady_tps": stat(*ratio), "decode_tps": stat(*ratio)}, "mlx_q4": None}
    return r


def _write(tmp_path, name, rows):
    p = tmp_path / name
    p.write_text(json.dumps(rows))
    return str(p)


def test_steady_rates_pooled_over_runs_with_the_paired_ratios(tmp_path):
    a = _write(tmp_path, "a.json", [_row("none", 8192, (100, 90, 110), (80, 70, 90)),
                                    _row("kivi", 8192, (70, 60, 75), (50, 40, 60), ratio=(0.7, 0.6, 0.8))])
    b = _write(tmp_path, "b.json", [_row("none", 8192, (120, 115, 130), (90, 85, 95)),
                                    _row("kivi", 8192, (90, 80, 95), (60, 55, 65), ratio=(0.75, 0.7, 0.9)),
                                    {"label": "mlx_q4", "context": 8192, "available": False, "decode_tps": None}])
    rate, tps, ratio = _module().collect([a, b])
    assert rate == "steady_tps"
    assert tps[("none", 8192)] == {"median": 110, "min": 90, "max": 130}
    assert tps[("kivi", 8192)] == {"median": 80, "min": 60, "max": 95}
    assert ratio == {("kivi", 8192): {"median": 0.725, "min": 0.6, "max": 0.9}}  # plain has no ratio row


def test_decode_rate_when_a_row_lacks_the_steady_rate(tmp_path):
    a = _write(tmp_path, "a.json", [_row("none", 4096, None, (80, 70, 90)),
                                    _row("kivi", 4096, (1, 1, 1), (40, 30, 50))])
    rate, tps, ratio = _module().collect([a])
    assert rate == "decode_tps" and tps[("kivi", 4096)]["median"] == 40 and not ratio


def test_writes_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write(tmp_path, "a.json", [_row("none", c, (100, 90, 110), (80, 70, 90)) for c in (8192, 32768)]
               + [_row("kivi", c, (70, 60, 75), (50, 40, 60), ratio=(0.7, 0.6, 0.8)) for c in (8192, 32768)])
    out = tmp_path / "plot.png"
    _module().main([a, "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
