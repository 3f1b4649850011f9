"""The SLO controller on a fake clock: AIMD on the limit, hysteresis, the degradation ladder."""

from tinyserve.core.slo import SloController


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def window(slo: SloController, clock: Clock, ttft: float, n: int = 20):
    for _ in range(n):
        slo.observe(ttft=ttft)
    clock.t += slo.window_s
    return slo.tick()


def test_violations_cut_the_limit_and_comfort_grows_it_back():
    clock = Clock()
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=100, clock=clock)
    stats = window(slo, clock, ttft=0.9)
    assert stats.violated and slo.limit == 70
    assert window(slo, clock, ttft=0.9) is None  # the window after a cut is not judged
    window(slo, clock, ttft=0.9)
    assert slo.limit == 49
    window(slo, clock, ttft=0.9)  # (paused)
    window(slo, clock, ttft=0.45)  # under the target but not comfortably: hold
    assert slo.limit == 49
    window(slo, clock, ttft=0.2)  # comfortable: an eighth more
    assert slo.limit == 55


def test_no_samples_no_judgement_and_disabled_does_nothing():
    clock = Clock()
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=10, clock=clock)
    clock.t += 10
    assert slo.tick() is None and slo.limit == 10
    off = SloController(None, None, max_limit=10, clock=clock)
    off.observe(ttft=99.0)
    clock.t += 10
    assert off.tick() is None and off.limit == 10 and not off.enabled


def test_persistent_violation_climbs_the_ladder_and_recovery_descends_it():
    clock = Clock()
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=20, clock=clock)
    for _ in range(6):  # every other window is a pause
        window(slo, clock, ttft=2.0)
    assert slo.level == 1 and "lowest priority" in slo.reason
    for _ in range(40):
        window(slo, clock, ttft=2.0)
    assert slo.level == 3 and slo.limit == 1
    while slo.level:
        window(slo, clock, ttft=0.1)
    assert slo.limit == 20 and slo.reason == ""  # back to normal only at the full limit


def test_scheduler_limits_follow_the_limit_and_never_starve_decodes():
    clock = Clock()
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=100, clock=clock)
    assert slo.scheduler_limits(64, 2048) == (64, 2048)
    window(slo, clock, ttft=9.0)
    assert slo.scheduler_limits(64, 2048) == (64, int(2048 * 0.7))
    slo.limit = 4
    assert slo.scheduler_limits(64, 2048) == (4, 81)
    slo.limit = 1
    assert slo.scheduler_limits(64, 100) == (1, 2)  # still room for the decode and a prompt


def test_itl_target_and_per_request_goodput():
    clock = Clock()
    slo = SloController(ttft_s=None, itl_s=0.05, max_limit=10, clock=clock)
    for _ in range(10):
        slo.observe(itls=(0.2, 0.2))
    clock.t += slo.window_s
    assert slo.tick().violated and slo.limit == 7
    both = SloController(ttft_s=1.0, itl_s=0.05, max_limit=10, clock=clock)
    assert both.met(0.5, (0.04, 0.06))  # the mean ITL counts
    assert not both.met(1.5, (0.01,)) and not both.met(None, ())


def test_refusing_under_a_cut_limit_climbs_the_ladder_even_with_latency_in_target():
    """After a cut, a server that keeps its targets only by turning requests away is
    overloaded: 3 such windows escalate. Refusals at the full limit are plain back-pressure."""
    clock, refused = Clock(), [0]
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=8, clock=clock,
                        pressure=lambda: refused[0])
    window(slo, clock, ttft=0.9)  # violated: 8 -> 5 (one overloaded window)
    window(slo, clock, ttft=0.1)  # (paused)
    refused[0] += 5
    window(slo, clock, ttft=0.1)  # comfortable (5 -> 6) but refusing under the cut limit
    assert slo.level == 0
    refused[0] += 1
    window(slo, clock, ttft=0.1)
    assert slo.level == 1 and "capacity" in slo.reason and slo.limit == 7
    refused[0] += 1
    window(slo, clock, ttft=0.1)  # 7 -> 8, still refusing under 7
    assert slo.limit == 8
    for _ in range(3):  # at the full limit refusals are back-pressure: calm windows
        refused[0] += 10
        window(slo, clock, ttft=0.1)
    assert slo.level == 0


def test_refusals_at_the_full_limit_never_climb_the_ladder():
    clock, refused = Clock(), [0]
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=8, clock=clock,
                        pressure=lambda: refused[0])
    for _ in range(10):
        refused[0] += 50
        window(slo, clock, ttft=0.1)
    assert (slo.level, slo.limit) == (0, 8)


def test_a_busy_window_without_samples_neither_grows_the_limit_nor_counts_as_calm():
    clock, refused = Clock(), [0]
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=100, clock=clock,
                        pressure=lambda: refused[0])
    window(slo, clock, ttft=0.9)  # 100 -> 70
    window(slo, clock, ttft=0.1)  # (paused)
    for _ in range(3):
        refused[0] += 1
        clock.t += slo.window_s
        assert slo.tick(idle=False) is not None  # refusals are evidence of overload...
    assert slo.limit == 70 and slo.level == 1  # ...but not of room for more


def test_idle_windows_are_calm_busy_windows_without_samples_are_not():
    clock = Clock()
    slo = SloController(ttft_s=0.5, itl_s=None, max_limit=8, clock=clock)
    slo._set_level(2, "test")
    for _ in range(3):
        clock.t += slo.window_s
        assert slo.tick(idle=False) is None  # busy, no first token: no evidence
    assert slo.level == 2
    for _ in range(3):
        clock.t += slo.window_s
        assert slo.tick(idle=True) is not None
    assert slo.level == 1


def test_a_disabled_controller_keeps_no_samples():
    """Without targets no window ever closes: samples kept would grow by one a token, for
    as long as the server runs."""
    off = SloController(None, None, max_limit=10)
    for _ in range(1000):
        off.observe(ttft=0.1, itls=(0.01, 0.0))
    assert off._ttft == [] and off._itl == []
