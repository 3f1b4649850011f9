"""Acceptance (issue 7): load stepped up to 2x capacity on a stand-in model of fixed step
cost. With --slo-ttft-ms the server keeps P95 TTFT under the target in at least 95% of the
windows after convergence, and its goodput is at least 1.5x that of the same server without.
(`python loadtest/bench_slo.py --phase-seconds 30` is the long version reported in README.)"""

from loadtest.bench_slo import run


def test_slo_control_keeps_ttft_and_goodput_under_twice_the_capacity():
    without = run(phase_seconds=12, slo_ttft_ms=None)
    with_slo = run(phase_seconds=12, slo_ttft_ms=400)
    met, windows = with_slo["windows_meeting_target"]
    print(f"\nwithout: {without}\nwith:    {with_slo}")
    assert windows >= 6 and met >= 0.95 * windows, with_slo
    assert with_slo["goodput_per_s"] >= 1.5 * without["goodput_per_s"], (with_slo, without)
    for r in (without, with_slo):
        assert r["lost"] == 0 and not any(r["idle_after"].values())
        assert set(r["status"]) <= {200, 429}  # turned away with 429, never failed
