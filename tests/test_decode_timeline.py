"""scripts/decode_timeline.py: Nsight Compute's kernel durations summed by kernel name, per decode step (the figures
of docs/RESULTS.md "A host that keeps pace")."""

import pytest

from scripts_util import load_script

_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
           '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _row(i, kernel, unit, value, metric="gpu__time_duration.sum"):
    return (f'"{i}","1","python3","h","{kernel}","1","7","(128, 1, 1)","(8, 65, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_kernel_times_sums_each_kernel_per_step_across_units(tmp_path):
    rows = [_row(0, "void mlx::gemv_single<__half, 8, 4>(const T1 *, int)", "us", "10.5"),
            _row(1, "vq_kivi_decode_mma_fused_e1b8", "ns", "98,000"),
            _row(2, "void mlx::gemv_single<__half, 8, 4>(const T1 *, int)", "usecond", "11.5"),
            _row(3, "vq_kivi_decode_mma_fused_e1b8", "ms", "0.1"),
            _row(4, "vq_kivi_decode_mma_fused_e1b8", "", "7", metric="sm__cycles_elapsed.avg")]
    path = tmp_path / "k.csv"
    path.write_text("==PROF== Connected to process 1\n" + "\n".join([_HEADER] + rows) + "\n")
    times = load_script("decode_timeline").kernel_times(str(path), steps=2)
    assert list(times) == ["vq_kivi_decode_mma_fused_e1b8", "void mlx::gemv_single<__half, 8, 4>"]  # largest first
    assert times["vq_kivi_decode_mma_fused_e1b8"] == pytest.approx((99.0, 1.0))  # (98 + 100) us over 2 steps
    assert times["void mlx::gemv_single<__half, 8, 4>"] == pytest.approx((11.0, 1.0))
