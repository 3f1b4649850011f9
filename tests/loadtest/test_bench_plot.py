"""loadtest/bench.py --plot draws its sweep: a PNG with both panels from the rows it printed."""

from tests.scripts import loadtest_script

bench = loadtest_script("bench")


def row(**kw):
    base = {f"{m}_{q}": 0.0 for m in ("ttft", "e2e") for q in ("p50", "p95", "p99")}
    return {**base, "tok_per_s": 0.0, "req_per_s": 0.0, "goodput_req_per_s": 0.0, **kw}


def test_plot_writes_a_png_with_both_panels(tmp_path):
    import matplotlib.image

    by_rate = [row(rate=r, ttft_p50=0.1 * r, ttft_p95=0.2 * r, ttft_p99=0.3 * r, e2e_p50=r,
                   e2e_p95=2 * r, e2e_p99=3 * r) for r in (1, 2, 4)]
    by_conc = [row(concurrency=c, tok_per_s=10 * c, req_per_s=c, goodput_req_per_s=c / 2)
               for c in (1, 4, 16)]
    path = tmp_path / "sweep.png"
    bench.plot(by_rate, by_conc, str(path), "test")
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 300 and img.shape[1] > 2 * img.shape[0]  # two panels side by side
    assert img[..., :3].std() > 0.05  # something was drawn


def test_the_sweep_flags_parse_and_a_summary_has_what_the_plot_reads():
    results = [bench.Result(ttft=0.5, e2e=2.0, tokens=10, itl=[0.1] * 9) for _ in range(4)]
    summary = bench.summarize("x", results, wall=4.0, sla_ttft=1.0, sla_tpot=0.5)
    assert {"ttft_p50", "ttft_p95", "ttft_p99", "e2e_p50", "e2e_p95", "e2e_p99", "tok_per_s",
            "req_per_s", "goodput_req_per_s"} <= set(summary)
    assert summary["goodput_req_per_s"] == 1.0 and summary["tok_per_s"] == 10.0


def test_error_answers_are_counted_not_fatal_and_never_good():
    ok = [bench.Result(ttft=0.5, e2e=2.0, tokens=10, itl=[0.1] * 9) for _ in range(3)]
    refused = [bench.Result(ttft=0.01, e2e=0.01, tokens=0, status=429) for _ in range(2)]
    summary = bench.summarize("x", ok + refused, wall=1.0, sla_ttft=1.0, sla_tpot=0.5)
    assert summary["requests"] == 5 and summary["errors"] == {"429": 2}
    assert summary["req_per_s"] == 3.0 and summary["goodput_req_per_s"] == 3.0
    assert summary["ttft_p50"] == 0.5  # latencies are the answered requests'


def test_plot_refuses_flag_combinations_it_cannot_honour():
    import pytest

    for argv in (["--plot", "x.png", "--config", "a=--x", "--config", "b=--y"],
                 ["--plot", "x.png", "--url", "http://h", "--config", "a=--x"],
                 ["--config", "no-equals-sign"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
