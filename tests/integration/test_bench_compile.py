"""`recsys-bench compile`: eager and compiled runs side by side, their loss deviation checked
(figures are not asserted here: timings belong to benchmark runs)."""

import pytest
from _bench import bench_report


@pytest.mark.timeout(200)
def test_bench_compile_reports_both_and_aot_eager_trains_the_eager_bits():
    args = ["--steps", "3", "--warmup", "1", "--reps", "2", "--backend", "aot_eager", "model.dropout=0.2"]
    report, _ = bench_report("compile", *args, timeout=180)
    assert set(report["ms_per_step"]) == {"eager", "compiled"}
    assert report["ratio_compiled_over_eager"]["median"] > 0
    assert report["compile"]["compile_graphs"] > 0 and report["compile"]["compile_graph_breaks"] > 0
    assert report["deviation"]["max_abs"] == 0.0  # aot_eager generates no code: the eager bits
    assert (report["deviation"]["rtol"], report["deviation"]["atol"]) == (1e-5, 1e-6)  # the stated tolerance
