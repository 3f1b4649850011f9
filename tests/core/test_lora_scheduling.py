"""LoRA slots in the scheduler (no model): at most max_loras distinct adapters in a step, an
adapter loaded with the plan of the first step that needs it, idle ones evicted least
recently used first, a sequence whose adapter finds no slot waits while others run, slots
given back on finish and preemption; and prefix-cache blocks never shared across adapters or
with the base."""

from tests.core.test_scheduler import create_requests, make_scheduler, run
from tinyserve.core.adapters import AdapterSpec
from tinyserve.core.lora_slots import LoraSlots
from tinyserve.core.scheduler import Scheduler, SchedulerConfig


def adapter(i: int) -> AdapterSpec:
    return AdapterSpec(f"a{i}", f"/adapters/a{i}", i, 8, 2.0, ("q_proj",))


def with_loras(max_loras: int, **kw):
    sched, ex = make_scheduler(**kw)
    kv = sched.kv
    cfg = SchedulerConfig(sched.cfg.max_num_seqs, sched.cfg.max_num_batched_tokens,
                          sched.cfg.max_model_len, sched.cfg.eos_token_ids, max_loras)
    return Scheduler(cfg, kv), ex


def test_at_most_max_loras_adapters_a_step_and_every_load_in_a_plan():
    sched, ex = with_loras(2, max_num_seqs=8, num_blocks=256)
    seqs = create_requests(12, 5, max_tokens=4)
    for i, s in enumerate(seqs):  # 4 adapters and the base, interleaved
        s.adapter = None if i % 5 == 4 else adapter(1 + i % 5)
    resident: dict[int, int] = {}  # slot -> adapter, as the runner's copies leave them

    def on_step(plan):
        for load in plan.lora_loads:
            resident[load.slot] = load.adapter_id
        by_id = {s.seq_id: s for s in seqs}
        in_step = {by_id[e.seq_id].adapter.adapter_id for e in plan.seqs
                   if by_id[e.seq_id].adapter is not None}
        assert len(in_step) <= 2, in_step
        for e in plan.seqs:
            a = by_id[e.seq_id].adapter
            if a is None:
                assert e.lora_slot == -1
            else:  # its slot holds its adapter (loaded by this plan or an earlier one)
                assert resident[e.lora_slot] == a.adapter_id, (e, resident)
        sched.lora_slots.check_integrity()

    run(sched, ex, seqs, on_step=on_step)
    assert sched.lora_slots.num_loads >= 4  # all four adapters ran, on two slots
    assert sched.lora_slots.held == set()
    assert all(s.finish_reason == "length" for s in seqs)


def test_a_sequence_without_a_slot_waits_and_the_base_goes_ahead():
    sched, ex = with_loras(1, max_num_seqs=8, num_blocks=256)
    first, second, base = create_requests(3, 5, max_tokens=6)
    first.adapter, second.adapter = adapter(1), adapter(2)
    for s in (first, second, base):
        sched.add(s)
        ex.tokens_by_seq[s.seq_id] = s.token_ids
    plan = sched.schedule()
    ids = [e.seq_id for e in plan.seqs]
    assert first.seq_id in ids and base.seq_id in ids and second.seq_id not in ids
    assert [(ld.slot, ld.adapter_id) for ld in plan.lora_loads] == [(0, 1)]
    sched.update(plan, ex.execute(plan))
    while not first.is_finished:
        plan = sched.schedule()
        assert second.seq_id not in [e.seq_id for e in plan.seqs]
        sched.update(plan, ex.execute(plan))
    plan = sched.schedule()  # slot 0 is free of holders: adapter 2 evicts adapter 1
    assert [(ld.slot, ld.adapter_id) for ld in plan.lora_loads] == [(0, 2)]
    assert second.seq_id in [e.seq_id for e in plan.seqs]


def test_slots_evict_the_least_recently_used_idle_adapter():
    slots = LoraSlots(2)
    assert slots.acquire(1, "p1", 1.0) == 0 and slots.acquire(2, "p2", 1.0) == 1
    slots.release(1)
    slots.release(2)
    assert slots.acquire(1, "p1", 1.0) == 0  # resident: no load
    slots.release(1)
    assert [ld.adapter_id for ld in slots.take_loads()] == [1, 2]
    assert slots.acquire(3, "p3", 1.0) == 1  # adapter 2 was idle longest
    assert slots.acquire(4, "p4", 1.0) == 0
    assert slots.acquire(5, "p5", 1.0) is None  # both held
    assert [ld.adapter_id for ld in slots.take_loads()] == [3, 4]
    slots.check_integrity()


def test_preemption_gives_the_slot_back_and_the_answer_stays_the_same():
    # a pool that preempts: every sequence still ends with the tokens it gets alone
    seqs = create_requests(6, 9, max_tokens=10)
    for i, s in enumerate(seqs):
        s.adapter = adapter(1 + i % 3)
    alone = {}
    for s in create_requests(6, 9, max_tokens=10):
        sched, ex = with_loras(3, num_blocks=64)
        run(sched, ex, [s])
        alone[s.seq_id] = list(s.token_ids)
    sched, ex = with_loras(2, num_blocks=8, block_size=4, max_model_len=20, budget=16)
    run(sched, ex, seqs, on_step=lambda plan: sched.lora_slots.check_integrity())
    assert sched.num_preemptions > 0
    assert {s.seq_id: list(s.token_ids) for s in seqs} == alone
    assert sched.lora_slots.held == set()


def test_prefix_blocks_are_never_shared_across_adapters_or_with_the_base():
    from tinyserve.core.engine_core import CoreConfig, EngineCore
    from tinyserve.messages import SamplingParams
    from tinyserve.models import STORIES260K
    from tinyserve.text.tokenizer import Tokenizer

    cfg = CoreConfig(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                     max_model_len=64, vocab_size=512, eos_token_ids=frozenset({2}),
                     max_loras=2)
    core = EngineCore(cfg, Tokenizer(STORIES260K))
    prompt = list(range(3, 23))  # 5 full blocks
    params = SamplingParams(max_tokens=1, temperature=0.0)
    _, ex = make_scheduler(num_blocks=64, block_size=4)

    def served(rid, a):
        req = core.add_request(rid, prompt, params, adapter=a)
        ex.tokens_by_seq[rid] = req.seq.token_ids
        while core.has_unfinished:
            plan = core.schedule()
            core.process(plan, ex.execute(plan))
        core.release(rid)
        return req.seq.num_cached_tokens

    assert served(1, adapter(1)) == 0
    assert served(2, adapter(2)) == 0  # same prompt, another adapter: no hit
    assert served(3, None) == 0  # the base model: no hit
    assert served(4, adapter(1)) == 16  # its own adapter's blocks: a hit
    assert served(5, None) == 16
    core.kv.pool.check_integrity()
