"""Scheduler + KV cache manager on a fake executor: no model, no torch.

The fake executor keeps a fake KV cache whose slot for position p holds a fingerprint of the
sequence's tokens [0..p] (real K/V at p depends on exactly those). Every step it checks that
each sequence reads back its own fingerprints through its block table: a prefix-cache hit, a
preemption or a chunk boundary that corrupted or mixed up KV would fail here. The sampled
token is a function of the sequence's tokens only, so outputs must not depend on batching.
"""

import hashlib

import pytest

from tinyserve.core.block_pool import BlockPool
from tinyserve.core.kv_manager import KVCacheManager, min_kv_blocks
from tinyserve.core.scheduler import Scheduler, SchedulerConfig
from tinyserve.core.sequence import Sequence
from tinyserve.messages import SamplingParams, SeqOutput, StepPlan, StepResult

VOCAB = 1000
EOS = 999


def fingerprint(tokens) -> bytes:
    return hashlib.blake2b(bytes(str(list(tokens)), "ascii"), digest_size=8).digest()


class FakeExecutor:
    def __init__(self, block_size: int, window: int | None = None) -> None:
        self.bs = block_size
        self.window = window  # every layer's sliding window: older keys are never read
        self.kv: dict[int, bytes] = {}
        self.tokens_by_seq: dict[int, list[int]] = {}
        self.tables: dict[int, list[int]] = {}  # the runner's persistent block table

    def apply_tables(self, plan: StepPlan) -> None:
        """What the runner does with a plan's block lists: rows of freed sequences go first;
        an entry extends the row the runner holds exactly where the plan says it ends."""
        for seq_id in plan.freed:
            self.tables.pop(seq_id, None)
        for s in plan.seqs:
            if s.first_block == 0:
                # a (re)start: the scheduler must have freed any row it had before
                assert s.seq_id not in self.tables, f"seq {s.seq_id} restarted without a free"
                self.tables[s.seq_id] = list(s.new_blocks)
            else:
                table = self.tables[s.seq_id]
                assert len(table) == s.first_block, (s.seq_id, len(table), s.first_block)
                table.extend(s.new_blocks)

    def execute(self, plan: StepPlan, only: set[int] | None = None) -> StepResult:
        """``only``: the entries to run (all by default); the tables take every entry."""
        self.apply_tables(plan)
        outs = []
        for s in plan.seqs:
            if only is not None and s.seq_id not in only:
                continue
            toks = self.tokens_by_seq[s.seq_id]
            end = s.start_pos + len(s.token_ids)
            assert list(s.token_ids) == toks[s.start_pos:end]
            table = self.tables[s.seq_id]
            assert len(table) * self.bs >= end
            oldest = 0 if self.window is None else max(0, s.start_pos - self.window + 1)
            for p in range(oldest, s.start_pos):  # read: the cached context must be its own
                slot = table[p // self.bs] * self.bs + p % self.bs
                assert self.kv.get(slot) == fingerprint(toks[: p + 1]), (s.seq_id, p)
            for p in range(s.start_pos, end):  # write this step's tokens
                slot = table[p // self.bs] * self.bs + p % self.bs
                self.kv[slot] = fingerprint(toks[: p + 1])
            if s.sample:
                outs.append(SeqOutput(s.seq_id, int.from_bytes(fingerprint(toks[:end]), "big")
                                      % (VOCAB - 1), 0.0))
        return StepResult(plan.step_id, tuple(outs))


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=64,
                   prefix=True, window=None):
    kv = KVCacheManager(BlockPool(num_blocks, block_size), enable_prefix_caching=prefix,
                        window=window)
    cfg = SchedulerConfig(max_num_seqs, budget, max_model_len, frozenset({EOS}))
    return Scheduler(cfg, kv), FakeExecutor(block_size, window)


def create_requests(n, num_tokens, max_tokens=8, start_id=0, shared_prefix=()):
    return [Sequence(start_id + i, tuple(shared_prefix) + tuple(
        (7 * (start_id + i) + j) % (VOCAB - 1) for j in range(num_tokens)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=0) for i in range(n)]


def run(sched, ex, seqs, max_steps=10_000, on_step=None):
    for s in seqs:
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids  # the same list: sees appended tokens
    steps = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        assert plan is not None, "no progress with work pending"
        assert plan.num_tokens <= sched.cfg.max_num_batched_tokens
        assert len(plan.seqs) <= sched.cfg.max_num_seqs
        sched.update(plan, ex.execute(plan))
        sched.kv.pool.check_integrity()
        check_tables(sched, ex)
        if on_step:
            on_step(plan)
        steps += 1
        assert steps < max_steps
    return {s.seq_id: (tuple(s.output_token_ids), s.finish_reason) for s in seqs}


def check_tables(sched, ex):
    """No step in flight: the runner holds a row for exactly the sequences that were sent
    blocks and not freed since, and each row is the sequence's leading blocks."""
    sent = {sid: s for sid, s in sched.seqs.items() if s.blocks_sent}
    assert set(ex.tables) == set(sent) | set(sched._freed), (set(ex.tables), set(sent))
    for sid, s in sent.items():
        assert ex.tables[sid] == s.block_ids[: s.blocks_sent], sid


def test_all_requests_finish_with_length_and_free_every_block():
    sched, ex = make_scheduler()
    seqs = create_requests(6, num_tokens=10, max_tokens=5)
    out = run(sched, ex, seqs)
    assert all(len(t) == 5 and r == "length" for t, r in out.values())
    assert sched.kv.pool.usage == 0.0


def test_decodes_and_prefill_chunks_share_a_step_under_the_token_budget():
    sched, ex = make_scheduler(budget=10)
    kinds = []
    run(sched, ex, create_requests(3, num_tokens=17, max_tokens=4),
        on_step=lambda plan: kinds.append(sorted(len(s.token_ids) for s in plan.seqs)))
    assert any(1 in k and max(k) > 1 for k in kinds), kinds  # a mixed step happened
    assert all(sum(k) <= 10 for k in kinds)


def test_chunked_prefill_samples_only_at_the_end_of_the_prompt():
    sched, ex = make_scheduler(budget=8)
    plans = []
    run(sched, ex, create_requests(1, num_tokens=20, max_tokens=2), on_step=plans.append)
    chunks = [(p.seqs[0].start_pos, len(p.seqs[0].token_ids), p.seqs[0].sample) for p in plans]
    assert chunks[:3] == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_outputs_do_not_depend_on_budget_or_batching():
    seqs_a = create_requests(5, num_tokens=13, max_tokens=6)
    seqs_b = create_requests(5, num_tokens=13, max_tokens=6)
    a = run(*make_scheduler(budget=64, max_num_seqs=8), seqs_a)
    b = run(*make_scheduler(budget=5, max_num_seqs=2), seqs_b)
    assert a == b


def test_prefix_cache_hit_computes_only_the_tail():
    sched, ex = make_scheduler(block_size=16, num_blocks=32, max_model_len=128)
    prefix = tuple(range(100, 164))  # 64 tokens = 4 full blocks
    [first] = create_requests(1, 10, max_tokens=2, shared_prefix=prefix)
    run(sched, ex, [first])
    computed_before = sched.num_prompt_tokens_computed
    [second] = create_requests(1, 7, max_tokens=2, start_id=1, shared_prefix=prefix)
    plans = []
    run(sched, ex, [second], on_step=plans.append)
    assert second.num_cached_tokens == 64
    assert plans[0].seqs[0].start_pos == 64
    assert sched.num_prompt_tokens_computed - computed_before == 7
    assert sched.kv.prefix_hits == 64 and sched.kv.prefix_queries == 74 + 71


def test_prefix_cache_respects_the_salt():
    sched, ex = make_scheduler(block_size=16, num_blocks=32, max_model_len=128)
    prefix = tuple(range(100, 164))
    [a] = create_requests(1, 10, shared_prefix=prefix)
    [b] = create_requests(1, 10, start_id=1, shared_prefix=prefix)
    b.cache_salt = b"other-tenant"
    run(sched, ex, [a])
    run(sched, ex, [b])
    assert b.num_cached_tokens == 0


def test_full_prompt_hit_still_computes_the_last_token():
    sched, ex = make_scheduler(block_size=4)
    [a] = create_requests(1, 8, max_tokens=1)
    [b] = create_requests(1, 8, max_tokens=1)
    b.seq_id = 1
    run(sched, ex, [a])
    plans = []
    run(sched, ex, [b], on_step=plans.append)
    assert plans[0].seqs[0].start_pos == 4 and b.num_cached_tokens == 4  # not 8
    assert b.output_token_ids == a.output_token_ids


def test_preemption_under_a_tiny_pool_loses_nothing():
    big = run(*make_scheduler(num_blocks=256), create_requests(8, num_tokens=14, max_tokens=12))
    sched, ex = make_scheduler(num_blocks=12, block_size=4, max_model_len=32)
    small = run(sched, ex, create_requests(8, num_tokens=14, max_tokens=12))
    assert small == big
    assert sched.num_preemptions > 0
    assert sched.kv.pool.usage == 0.0


def test_recompute_after_preemption_is_not_counted_as_a_request_hit():
    sched, ex = make_scheduler(num_blocks=12, block_size=4, max_model_len=32)
    seqs = create_requests(8, num_tokens=14, max_tokens=12)
    run(sched, ex, seqs)
    assert any(s.num_preemptions for s in seqs)
    assert sched.kv.prefix_hits == 0 and sched.kv.prefix_queries == 8 * 14


def test_abort_frees_blocks_mid_run():
    sched, ex = make_scheduler()
    seqs = create_requests(3, num_tokens=10, max_tokens=20)
    for s in seqs:
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids
    plan = sched.schedule()
    sched.update(plan, ex.execute(plan))
    assert sched.kv.pool.usage > 0
    sched.abort(1)
    assert seqs[1].finish_reason == "abort" and seqs[1].block_ids == []
    for s in (seqs[0], seqs[2]):
        sched.abort(s.seq_id)
    assert sched.kv.pool.usage == 0.0 and not sched.has_unfinished
    sched.kv.pool.check_integrity()


def test_results_for_an_aborted_sequence_are_ignored():
    sched, ex = make_scheduler()
    [seq] = create_requests(1, num_tokens=5)
    sched.add(seq)
    ex.tokens_by_seq[0] = seq.token_ids
    plan = sched.schedule()
    result = ex.execute(plan)
    sched.abort(0)  # the client went away while the step ran
    assert sched.update(plan, result) == []
    assert seq.output_token_ids == []


def test_step_error_finishes_its_sequences_with_error():
    sched, ex = make_scheduler()
    seqs = create_requests(2, num_tokens=5)
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    updated = sched.update(plan, StepResult(plan.step_id, (), error="boom"))
    assert {s.finish_reason for s in updated} == {"error"}
    assert sched.kv.pool.usage == 0.0


def test_eos_and_max_model_len_stop_sequences():
    sched, ex = make_scheduler(max_model_len=16)
    [seq] = create_requests(1, num_tokens=10, max_tokens=100)
    out = run(sched, ex, [seq])
    assert out[0][1] == "length" and seq.num_tokens == 16
    sched2, _ = make_scheduler()
    [s2] = create_requests(1, num_tokens=3)
    sched2.add(s2)
    plan = sched2.schedule()
    sched2.update(plan, StepResult(plan.step_id, (SeqOutput(0, EOS, 0.0),)))
    assert s2.finish_reason == "stop"


def test_prompt_longer_than_the_context_is_rejected():
    sched, _ = make_scheduler(max_model_len=16)
    [seq] = create_requests(1, num_tokens=16)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq)


def test_pool_smaller_than_one_full_sequence_is_rejected():
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=3, block_size=4, max_model_len=64)


def test_max_num_seqs_caps_the_running_set():
    sched, ex = make_scheduler(max_num_seqs=2)
    seen = []
    run(sched, ex, create_requests(5, num_tokens=4, max_tokens=3),
        on_step=lambda plan: seen.append(len(plan.seqs)))
    assert max(seen) == 2


def _with_priority(seqs, priority):
    for s in seqs:
        s.priority = priority
    return seqs


def test_waiting_queue_runs_higher_priority_first():
    sched, ex = make_scheduler(max_num_seqs=2)
    low = _with_priority(create_requests(3, num_tokens=6, max_tokens=3), 0)
    high = _with_priority(create_requests(2, num_tokens=6, max_tokens=3, start_id=10), 5)
    first = []
    run(sched, ex, low + high,
        on_step=lambda plan: first.append(tuple(s.seq_id for s in plan.seqs)) if not first else None)
    assert set(first[0]) == {10, 11}  # added last, scheduled first


def test_kv_pressure_preempts_the_lowest_priority_and_everything_still_finishes_unchanged():
    reference = run(*make_scheduler(num_blocks=64, block_size=4),
                    create_requests(6, num_tokens=12, max_tokens=10))
    sched, ex = make_scheduler(num_blocks=16, block_size=4, max_model_len=32)
    seqs = create_requests(6, num_tokens=12, max_tokens=10)
    for s in seqs:
        s.priority = 1 if s.seq_id in (0, 1) else 0
    preempted = set()
    real = sched._preempt

    def spy(seq):
        preempted.add(seq.seq_id)
        real(seq)

    sched._preempt = spy
    assert run(sched, ex, seqs) == reference
    assert preempted and not preempted & {0, 1}  # the high-priority pair was never a victim
    assert sched.kv.pool.usage == 0.0


def test_a_higher_priority_arrival_displaces_a_running_lower_one_at_max_num_seqs():
    sched, ex = make_scheduler(max_num_seqs=2)
    low = create_requests(2, num_tokens=5, max_tokens=20)
    for s in low:
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids
    sched.update(plan := sched.schedule(), ex.execute(plan))
    assert sched.num_running == 2
    [high] = _with_priority(create_requests(1, num_tokens=5, max_tokens=3, start_id=7), 9)
    out = run(sched, ex, [high], on_step=lambda plan: None)
    assert out[7][1] == "length"
    assert low[1].num_preemptions == 1 and low[0].num_preemptions == 0  # the newest low one
    assert all(s.finish_reason == "length" for s in low)  # and it still finished


def _first_steps(sched, ex, seqs):
    """-> seq id -> the step in which it was first scheduled."""
    first, step = {}, [0]

    def on_step(plan):
        step[0] += 1
        for s in plan.seqs:
            first.setdefault(s.seq_id, step[0])

    return run(sched, ex, seqs, on_step=on_step), first


def test_a_flooding_tenant_does_not_starve_another_of_the_same_priority():
    flood = create_requests(20, num_tokens=6, max_tokens=6)
    quiet = create_requests(2, num_tokens=6, max_tokens=6, start_id=100)
    for s in flood:
        s.tenant = "flood"
    for s in quiet:
        s.tenant = "quiet"
    out, first = _first_steps(*make_scheduler(max_num_seqs=2), flood + quiet)
    # FIFO would start quiet's after all 20 flood requests (~60 steps); by served tokens it
    # gets the next free slot, and its second request the one after.
    assert first[100] <= 8 and first[101] <= 16, first
    assert all(reason == "length" for _, reason in out.values())


def test_an_idle_tenant_gets_no_credit_for_its_idle_time():
    sched, ex = make_scheduler(max_num_seqs=1)
    [early] = create_requests(1, num_tokens=6, max_tokens=4)
    early.tenant = "a"
    run(sched, ex, [early])  # tenant a was served, then went idle
    a_before = sched.served["a"]
    b = create_requests(2, num_tokens=30, max_tokens=8, start_id=10)
    for s in b:
        s.tenant = "b"
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids
    while sched.served["b"] <= a_before + 20:  # b is served well past a's old count
        sched.update(plan := sched.schedule(), ex.execute(plan))
    [late] = create_requests(1, num_tokens=6, max_tokens=4, start_id=20)
    late.tenant = "a"
    sched.add(late)
    # a rejoins at b's count: its old, smaller one would let it jump ahead by 20+ tokens
    assert sched.served["a"] == sched.served["b"] > a_before


def test_a_higher_priority_arrival_takes_blocks_from_lower_ones_when_the_pool_is_dry():
    reference = run(*make_scheduler(num_blocks=64, block_size=4),
                    create_requests(4, num_tokens=12, max_tokens=12)
                    + create_requests(1, num_tokens=8, max_tokens=3, start_id=50))
    sched, ex = make_scheduler(num_blocks=16, block_size=4, max_model_len=32, max_num_seqs=8)
    low = create_requests(4, num_tokens=12, max_tokens=12)
    for s in low:
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids
    for _ in range(3):  # the low ones fill the pool
        sched.update(plan := sched.schedule(), ex.execute(plan))
        sched.kv.pool.check_integrity()
    assert sched.kv.pool.num_available < 3
    [high] = _with_priority(create_requests(1, num_tokens=8, max_tokens=3, start_id=50), 9)
    sched.add(high)
    ex.tokens_by_seq[50] = high.token_ids
    plan = sched.schedule()
    assert 50 in {s.seq_id for s in plan.seqs}  # scheduled at once, not after a low one ends
    sched.update(plan, ex.execute(plan))
    assert sum(s.num_preemptions for s in low) >= 1
    assert run(sched, ex, []) == {}  # drain what is left
    assert {s.seq_id: (tuple(s.output_token_ids), s.finish_reason) for s in low + [high]} \
        == reference
    assert sched.kv.pool.usage == 0.0


# -- planning ahead (the server's overlap: a step planned while the previous one runs) ------


class EosExecutor(FakeExecutor):
    """Ends about one sequence in five early with EOS (a function of its tokens, as above)."""

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        return StepResult(plan.step_id, tuple(
            SeqOutput(o.seq_id, EOS if o.token_id % 5 == 0 else o.token_id, o.logprob)
            for o in result.outputs))


def run_ahead(sched, ex, seqs, on_plan=None):
    """Like ``run``, but with two steps in flight, as the server's batcher keeps them: step
    N+1 is planned before step N's result is applied, its placeholder tokens filled in from
    step N's output the way the executor does."""
    import collections

    from tinyserve.messages import PLACEHOLDER

    for s in seqs:
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids
    in_flight, sampled, steps = collections.deque(), {}, 0
    while sched.has_unfinished or in_flight:
        while len(in_flight) < 2 and sched.has_unfinished:
            plan = sched.schedule()
            if plan is None:
                break
            if on_plan:
                on_plan(plan)
            in_flight.append(plan)
        assert in_flight, "no progress with work pending"
        plan = in_flight.popleft()
        filled = []
        for s in plan.seqs:
            if s.token_ids and s.token_ids[-1] == PLACEHOLDER:
                if s.seq_id not in sampled:
                    continue  # (its sequence ended with the step before)
                s = type(s)(**{**{f: getattr(s, f) for f in s.__struct_fields__},
                               "token_ids": s.token_ids[:-1] + (sampled[s.seq_id],)})
            assert PLACEHOLDER not in s.token_ids
            filled.append(s)
        result = ex.execute(StepPlan(plan.step_id, tuple(filled), freed=plan.freed))
        sampled = {o.seq_id: o.token_id for o in result.outputs}
        sched.update(plan, result)
        sched.kv.pool.check_integrity()
        steps += 1
        assert steps < 10_000
    assert set(ex.tables) == set(sched._freed)  # every row is freed with the next plan
    return {s.seq_id: (tuple(s.output_token_ids), s.finish_reason) for s in seqs}


@pytest.mark.parametrize("kw", [
    dict(),
    dict(budget=5, max_num_seqs=3),  # chunked prefill behind decodes
    dict(num_blocks=12, block_size=4, max_model_len=32),  # preemption under a tiny pool
    dict(num_blocks=20, block_size=4, max_model_len=40, budget=7),
], ids=["plain", "chunked", "preempting", "both"])
@pytest.mark.parametrize("executor", [FakeExecutor, EosExecutor])
def test_planning_ahead_gives_the_same_outputs_and_frees_every_block(kw, executor):
    def requests():
        return create_requests(8, num_tokens=14, max_tokens=12) + create_requests(
            3, num_tokens=5, max_tokens=1, start_id=50, shared_prefix=tuple(range(200, 216)))

    sched, _ = make_scheduler(**kw)
    solo_plans = []
    alone = run(sched, executor(sched.kv.block_size), requests(), on_step=solo_plans.append)
    sched, _ = make_scheduler(**kw)
    plans = []
    ahead = run_ahead(sched, executor(sched.kv.block_size), requests(), on_plan=plans.append)
    assert ahead == alone
    assert sched.kv.pool.usage == 0.0 and not sched.seqs
    # It really planned ahead: some step read a token its predecessor had not returned yet.
    assert any(-1 in s.token_ids for p in plans for s in p.seqs)
    if executor is FakeExecutor and not sched.num_preemptions:
        # Finishing by length is foreseen: planning ahead computes no token in vain.
        assert sum(p.num_tokens for p in plans) == sum(p.num_tokens for p in solo_plans)


# -- a sliding window on every layer: blocks behind it are given back -------------------------


def test_a_window_on_every_layer_bounds_the_blocks_a_sequence_holds():
    """Window 8, blocks of 4: a 60-token sequence holds at most window + a step of blocks, the
    pool (7 blocks) is far smaller than max_model_len (16 blocks), the fake executor checks
    every key a query can still see, and the outputs equal an unwindowed run's (the fake
    model's tokens depend on the tokens only)."""
    def requests():
        return create_requests(3, num_tokens=10, max_tokens=50) + create_requests(
            2, num_tokens=3, max_tokens=30, start_id=50, shared_prefix=tuple(range(200, 212)))

    reference = run(*make_scheduler(num_blocks=64, budget=8), requests())
    sched, ex = make_scheduler(num_blocks=7, budget=8, window=8)
    assert min_kv_blocks(64, 4, 8, 8) == 7 and min_kv_blocks(64, 4, None, 8) == 16
    most = []

    def held(plan):
        most.append(max((sched.kv.held(q) for q in sched.seqs.values()), default=0))
        for q in sched.seqs.values():  # never a dropped block's id handed out twice to it
            live = q.block_ids[q.num_dropped_blocks:]
            assert len(set(live)) == len(live)

    assert run(sched, ex, requests(), on_step=held) == reference
    assert sched.kv.pool.usage == 0.0
    assert max(most) <= 7
    # a decoding sequence settles at the window's blocks plus the one being written
    assert most[-1] <= 8 // 4 + 1


def test_a_window_shrinks_the_pool_check_and_planning_ahead_still_matches():
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(num_blocks=6, budget=8, window=8)  # one sequence could starve
    sched, _ = make_scheduler(num_blocks=7, budget=8, window=8)
    reqs = lambda: create_requests(4, num_tokens=9, max_tokens=40)  # noqa: E731
    alone = run(sched, FakeExecutor(4, 8), reqs())
    sched, _ = make_scheduler(num_blocks=7, budget=8, window=8)
    assert run_ahead(sched, FakeExecutor(4, 8), reqs()) == alone
    assert sched.kv.pool.usage == 0.0 and not sched.seqs
    assert alone == run(*make_scheduler(), reqs())  # as without a window, with 64 blocks


class EagerToStop(FakeExecutor):
    """Samples a stop token whenever the draw does not ban it, else the fake's usual token."""

    def __init__(self, block_size: int, stop: int) -> None:
        super().__init__(block_size)
        self.stop = stop

    def execute(self, plan: StepPlan, only: set[int] | None = None) -> StepResult:
        result = super().execute(plan, only)
        banned = {s.seq_id: s.banned for s in plan.seqs}
        return StepResult(plan.step_id, tuple(
            o if self.stop in banned[o.seq_id] else SeqOutput(o.seq_id, self.stop, 0.0)
            for o in result.outputs))


@pytest.mark.parametrize("stop", [EOS, 5], ids=["eos", "stop_token_id"])
@pytest.mark.parametrize("min_tokens", [1, 3])
def test_the_token_right_after_min_tokens_may_be_the_stop_token(min_tokens, stop):
    sched, _ = make_scheduler()
    ex = EagerToStop(4, stop)
    [seq] = create_requests(1, num_tokens=6, max_tokens=10)
    seq.params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=min_tokens,
                                stop_token_ids=(5,))
    [(tokens, reason)] = run(sched, ex, [seq]).values()
    # draws 1..min_tokens ban it; draw min_tokens + 1 (the first allowed) takes it
    assert reason == "stop" and len(tokens) == min_tokens + 1 and tokens[-1] == stop
    assert stop not in tokens[:-1]
