"""Smoke test: the radix benchmark's workloads run and leave consistent books (speed is not tested)."""

from tools.bench import bench_radix


def test_every_benchmark_mode_runs_on_a_slice_of_the_workload():
    requests = bench_radix.workload(0)[:40]
    assert len(requests[0][0]) == 640 and len(requests[0][1]) == 768
    for bounded in (False, True):
        assert bench_radix.run_index(requests, 16, bounded) >= 0
        assert bench_radix.run_index_hybrid(requests, 16, bounded) >= 0
        for hybrid in (False, True):
            assert bench_radix.run_coordinator(requests, 16, bounded, hybrid) >= 0
