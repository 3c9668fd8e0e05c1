"""`recsys-bench raw_ids --quick`: managed tables (each policy), hash and modulo trained side by side
on one generated stream, each reported (figures are not asserted: timings belong to benchmark runs,
docs/benchmarks.md)."""

import pytest
from _bench import bench_report


@pytest.mark.timeout(300)
def test_bench_raw_ids_quick_reports_every_variant_side_by_side():
    report, printed = bench_report("raw_ids", "--quick", "--steps", "24", timeout=280)
    variants = report["variants"]
    assert list(variants) == ["managed/lfu", "managed/lru", "managed/distance_lfu", "hash", "modulo"]
    for figures in variants.values():
        assert 0.3 < figures["auc"]["median"] < 1 and figures["samples_per_s"]["median"] > 0
        assert figures["samples_per_cpu_s"]["median"] > 0 and figures["peak_rss_mib"]["median"] > 100
    targets = report["targets"]
    assert targets["best_managed"].startswith("managed/")
    assert set(targets["samples_per_s_over_hash"]) == {"managed/lfu", "managed/lru", "managed/distance_lfu"}
    assert report["stream"]["train_rows"] == 24 * 128 and "AUC, best managed" in printed
