"""The model runner: persistent block tables, decode buckets (padding + recorded launches), and
the warm-up. Greedy outputs must not depend on the path: bucket padding on or off
(``enforce_eager``), and both equal to transformers on a random GQA model."""

import asyncio

import numpy as np
import pytest
import torch

from tinyserve import LLM, SamplingParams
from tinyserve.actors.executor import Executor
from tinyserve.core.engines import StepFunction
from tinyserve.engine.running.block_tables import BlockTables
from tinyserve.engine.running.buckets import decode_buckets
from tinyserve.engine.running.warmup import eager_warm_shapes, warm_up
from tinyserve.kernels.utils import Recording, recording
from tinyserve.messages import ScheduledSeq, StepPlan, StepResult

GREEDY = SamplingParams(temperature=0.0)


def entry(seq_id, first, new, start_pos=0, n_tokens=1):
    return ScheduledSeq(seq_id, (5,) * n_tokens, start_pos, tuple(new), True, GREEDY, 0,
                        first_block=first)


def test_decode_buckets():
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
    assert decode_buckets(5) == (1, 2, 4, 5)
    assert decode_buckets(1) == (1,)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)


# -- block tables ------------------------------------------------------------------------------
def test_block_table_rows_grow_by_new_blocks_and_are_reused_when_freed():
    t = BlockTables(num_rows=2, width=4, block_size=4)
    rows, upd = t.apply((), [entry(1, 0, [7, 3], start_pos=5), entry(2, 0, [9], start_pos=2)])
    assert rows[0] != rows[1] and len(t) == 2
    assert list(t.host[rows[0], :2]) == [7, 3] and t.host[rows[1], 0] == 9
    assert sorted(upd) == sorted([(rows[0], 0, 7), (rows[0], 1, 3), (rows[1], 0, 9)])
    rows2, upd2 = t.apply((), [entry(1, 2, [], start_pos=6)])  # a decode inside its last block
    assert rows2 == [rows[0]] and upd2 == []
    rows3, upd3 = t.apply((), [entry(1, 2, [4], start_pos=8)])  # crossed into a new block
    assert upd3 == [(rows[0], 2, 4)] and list(t.host[rows[0], :3]) == [7, 3, 4]
    rows4, _ = t.apply((2,), [entry(3, 0, [1])])  # 2's row is freed first, then 3 takes it
    assert rows4 == [rows[1]] and 2 not in t.rows
    rows5, _ = t.apply((), [entry(1, 0, [6])])  # a restart (preempted): the row starts afresh
    assert rows5 == [rows[0]] and t.lengths[rows[0]] == 1


@pytest.mark.parametrize("bad, match", [
    (entry(1, 1, [8], start_pos=4), "holds 2"),  # blocks missing in between
    (entry(9, 3, [8], start_pos=12), "holds 0"),  # never seen
    (entry(1, 2, [8, 9, 10], start_pos=8), "width"),
    (entry(1, 2, [], start_pos=8), "cannot hold"),
])
def test_a_plan_that_does_not_match_the_table_is_refused_before_any_change(bad, match):
    t = BlockTables(num_rows=3, width=4, block_size=4)
    t.apply((), [entry(1, 0, [7, 3], start_pos=4)])
    before = (t.host.copy(), t.lengths.copy(), dict(t.rows))
    with pytest.raises(ValueError, match=match):
        t.apply((), [entry(2, 0, [5]), bad])
    assert np.array_equal(t.host, before[0]) and np.array_equal(t.lengths, before[1])
    assert dict(t.rows) == before[2]


def test_a_full_table_drops_the_least_recently_used_row_outside_the_plan():
    t = BlockTables(num_rows=2, width=4, block_size=4)
    t.apply((), [entry(1, 0, [1])])
    t.apply((), [entry(2, 0, [2])])
    t.apply((), [entry(1, 1, [], start_pos=1)])  # 1 is used again: 2 is the older
    t.apply((), [entry(3, 0, [3])])  # (a lost ``freed`` list): 2's row goes
    assert set(t.rows) == {1, 3}
    with pytest.raises(ValueError, match="holds 0"):  # 2 comes back: loud, not a wrong read
        t.apply((), [entry(2, 1, [], start_pos=1)])
    with pytest.raises(ValueError, match="more than 2"):
        t.apply((), [entry(1, 1, [], start_pos=1), entry(3, 1, [], start_pos=1), entry(4, 0, [4])])


# -- recording ---------------------------------------------------------------------------------
def test_recording_pools_scratch_by_phase_and_replays_launches():
    calls = []

    class Kernel:
        def run(self, *args, grid, warmup, **meta):
            calls.append((args, grid, meta))

    from tinyserve.kernels.utils import empty, launch, phase

    rec = Recording(capacity=8)
    with recording(rec):
        phase("head")
        h = empty((3, 4), torch.float32, "cpu")
        layer_bufs = []
        for _ in range(2):
            phase("layer")
            layer_bufs.append((empty((3, 4), torch.float32, "cpu"), empty((3, 4), torch.float32, "cpu")))
            launch(Kernel(), (1,), h, X=1)
        with pytest.raises(ValueError, match="capacity"):
            empty((9, 4), torch.float32, "cpu")
        with pytest.raises(ValueError, match="already active"):
            with recording(Recording(8)):
                pass
    a, b = layer_bufs
    assert a[0].data_ptr() == b[0].data_ptr() and a[1].data_ptr() == b[1].data_ptr()  # shared
    assert a[0].data_ptr() != a[1].data_ptr() and h.data_ptr() not in (a[0].data_ptr(), a[1].data_ptr())
    assert a[0].shape == (3, 4)
    assert len(rec.launches) == 2 and len(calls) == 2
    rec.replay()
    assert len(calls) == 4 and calls[-1][1] == (1,) and calls[-1][2] == {"X": 1}
    assert empty((2, 2), torch.float32, "cpu").shape == (2, 2)  # no recording: plain torch.empty


# -- the runner on stories260k -----------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(stories_dir):
    return {eager: LLM(str(stories_dir), dtype="float32", max_num_seqs=8, enforce_eager=eager)
            for eager in (False, True)}


PROMPTS = ["The little dog", "Once upon a time", "Lily and Ben went to the park. They saw",
           [1, 403], "Tom had a red ball", "The sun"]


def test_greedy_is_identical_with_and_without_bucket_padding(llms):
    # 6 sequences (bucket 8), then fewer as they finish at different lengths (buckets 4, 2, 1)
    params = [SamplingParams(max_tokens=n, temperature=0.0, logprobs=2) for n in (30, 9, 17, 4, 23, 12)]
    padded, eager = (llms[e].generate(PROMPTS, params) for e in (False, True))
    for a, b in zip(padded, eager, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # bit for bit: the padding never touches a real row
    runner = llms[False].engine.runner
    assert {8, 4, 2, 1} <= {b for b, _ in runner.buckets.recorded}, "the padded path did not run"
    assert not llms[True].engine.runner.buckets.recorded


def test_sampled_requests_are_identical_with_and_without_padding(llms):
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=s)
              for s in range(5)]
    padded, eager = (llms[e].generate(PROMPTS[:5], params) for e in (False, True))
    assert [o.token_ids for o in padded] == [o.token_ids for o in eager]


def test_runner_tables_are_released_and_a_freed_only_plan_runs(llms):
    llm = llms[False]
    runner = llm.engine.runner
    llm.generate(PROMPTS[:3], GREEDY)
    pending = llm.core.scheduler._freed  # released after their last step: sent with the next plan
    assert len(runner.tables) == len(pending) == 3
    # the device table mirrors the host's (every host write went down as an update)
    assert torch.equal(runner.table_dev.cpu(), torch.from_numpy(runner.tables.host))
    result = runner.execute(StepPlan(10**6, (), freed=tuple(pending)))
    assert result.outputs == () and len(runner.tables) == 0
    llm.core.scheduler._freed.clear()


def test_a_refused_step_still_gives_its_freed_rows_back(llms):
    runner = llms[False].engine.runner
    runner.execute(StepPlan(1, (entry(777, 0, [3], start_pos=0),)))
    assert 777 in runner.tables.rows
    beyond = entry(778, 0, [1] * 40, start_pos=runner.model.rope.max_positions)  # past the rotary table
    with pytest.raises(ValueError, match="rotary"):
        runner.execute(StepPlan(2, (beyond,), freed=(777,)))
    assert 777 not in runner.tables.rows and 778 not in runner.tables.rows


def test_an_out_of_sync_plan_fails_its_step_and_the_runner_goes_on(llms):
    runner = llms[False].engine.runner
    with pytest.raises(ValueError, match="holds 0"):
        runner.execute(StepPlan(1, (entry(424242, 3, [1], start_pos=40),)))
    [out] = llms[False].generate("The little dog", SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out.token_ids) == 3


def test_warm_up_records_every_bucket_so_serving_records_none(stories_dir):
    llm = LLM(str(stories_dir), dtype="float32", max_num_seqs=5)
    runner = llm.engine.runner
    on_gpu = runner.device.type == "cuda"  # (the LLM warmed up already: it compiles there)
    # the interpreter: nothing to compile, buckets recorded lazily
    assert warm_up(runner)["buckets"] == ([1, 2, 4, 5] if on_gpu else [])
    info = warm_up(runner, compile_all=True)  # what a GPU runs
    classes = runner.buckets.split_classes()
    assert info["buckets"] == [1, 2, 4, 5] and info["split_classes"] == classes
    assert runner.buckets.recorded == {(b, c) for b in (1, 2, 4, 5) for c in classes}
    # 6 variants x 4 bucket sizes x (raw, processed, masked, both), and prompt logprobs (2 x 4)
    assert info["cuda_graphs"] is on_gpu and info["sampling_variants"] == 6 * 4 * 4 + 2 * 4
    if on_gpu:  # every bucket captured at once, on this thread
        assert info["graphs_captured"] in (0, len(runner.buckets.recorded))
    else:
        assert classes == [512]  # (CPU split 4096: the shapes below are the CPU's)
    # chunks of 16 and 17 alone, 16 rows of 32, then 1/2/15/16 decodes beside a chunk of 16,
    # at one KV split (the only split on the CPU: 4096 keys)
    shapes = eager_warm_shapes(runner)
    assert info["eager_shapes"] == len(shapes)
    if not on_gpu:
        assert shapes[:3] == [((), (16,)), ((), (17,)), ((512,) * 15, (17,))]
        assert shapes[3:] == [((512,) * n, (16,)) for n in (1, 2, 15, 16)]
        assert info["eager_shapes"] == 7
    recorded = runner.buckets.recorded
    llm.generate(PROMPTS[:5], SamplingParams(max_tokens=6, temperature=0.0))
    assert runner.buckets.recorded == recorded  # serving (which records what it lacks) added nothing


def test_split_classes_round_the_longest_sequence_up_to_a_power_of_two_of_splits(llms):
    buckets = llms[False].engine.runner.buckets
    from tinyserve.kernels.attention_decode import default_split_size

    split = default_split_size()
    buckets.max_model_len, saved = 5 * split, buckets.max_model_len
    try:
        assert buckets.split_classes() == [split, 2 * split, 4 * split, 5 * split]
        assert buckets.split_class(1) == split and buckets.split_class(split + 1) == 2 * split
        assert buckets.split_class(3 * split) == 4 * split
        assert buckets.split_class(4 * split + 1) == 5 * split  # capped
    finally:
        buckets.max_model_len = saved


def test_a_budget_cut_one_token_prompt_chunk_next_to_decodes_runs_eager(stories_dir):
    # max_num_batched_tokens == max_num_seqs: three 2-token prompts decode, the long one gets
    # the one token left beside them, a chunk that does not sample (steps 3-5); such a step
    # cannot take the decode buckets
    outs, cut_steps = {}, []
    for eager in (False, True):
        llm = LLM(str(stories_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=4,
                  enforce_eager=eager)
        execute = llm.engine.runner.execute

        def watch(plan, execute=execute):
            if plan.seqs and all(len(s.token_ids) == 1 for s in plan.seqs) \
                    and not all(s.sample for s in plan.seqs):
                cut_steps.append(plan.step_id)
            return execute(plan)

        llm.engine.runner.execute = watch
        outs[eager] = [o.token_ids for o in llm.generate(
            [[1, 403], [1, 300], [1, 200], [1, 400, 401, 402, 403]],
            SamplingParams(max_tokens=5, temperature=0.0))]
        assert all(len(t) == 5 for t in outs[eager])
    assert cut_steps, "the scenario did not come up"
    assert outs[False] == outs[True]


def test_executor_hands_a_plan_of_only_freed_rows_to_the_runner():
    seen = []

    def runner(plan):
        seen.append(plan)
        return StepResult(plan.step_id, ())

    async def main():
        ex = Executor({"m": StepFunction(runner)})
        out = asyncio.Queue()
        ex.outboxes["m"] = out
        ex.start()
        ex.inbox.put_nowait(("m", StepPlan(1, (), freed=(3, 4))))
        await asyncio.wait_for(out.get(), 5)
        await ex.stop()

    asyncio.run(main())
    assert [p.freed for p in seen] == [(3, 4)]


# -- a random GQA model against transformers ----------------------------------------------------
def test_greedy_matches_transformers_with_and_without_padding(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tinyserve.engine.loading.demo import write_tokenizer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.15, rms_norm_eps=1e-5)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 33)]
    n_new = 20
    want = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False,
                              min_new_tokens=n_new, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
    for eager in (False, True):
        llm = LLM(str(tmp_path), dtype="float32", max_num_seqs=4, enforce_eager=eager)
        got = [list(o.token_ids) for o in llm.generate(prompts, params)]
        assert got == want, f"enforce_eager={eager}"
        assert bool(llm.engine.runner.buckets.recorded) != eager  # padded buckets 4, 2, 1 did run
