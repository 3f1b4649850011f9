"""A request's own fault fails that request only (engine/running/faults.py): a step that
raises is run again without the sequences it can blame, and a row whose logits are not finite
ends its sequence while the rest of the step goes on. On stories260k, through the engine core
and the runner as the server drives them (the API's own checks bypassed, as a bug or a
poisoned file would)."""

import math

import msgspec
import pytest
import torch

from tinyserve import LLM, SamplingParams

PROMPTS = ["Once upon a time, there was a big", "Tom had a red ball", "One day"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(str(stories_dir), dtype="float32")


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def run(llm, poison):
    """Every prompt through the core and the runner; ``poison(seqs)`` changes the scheduler's
    sequences once they are added. Returns (outputs by prompt, every StepResult)."""
    core, runner = llm.core, llm.engine.runner
    reqs = [core.add_request(1000 + i, llm.tokenizer.encode(p), GREEDY)
            for i, p in enumerate(PROMPTS)]
    ids = [r.request_id for r in reqs]
    poison([r.seq for r in reqs])
    results = []
    while core.has_unfinished:
        plan = core.schedule()
        result = runner.execute(plan)
        results.append(result)
        core.process(plan, result)
    return [core.release(i).seq for i in ids], results


def test_a_step_that_raises_runs_again_without_the_sequence_it_blames(llm, alone):
    """top_k 2^40 passed no check here: staging it overflows int32 and the step raises."""
    def poison(seqs):
        seqs[1].params = msgspec.structs.replace(seqs[1].params, temperature=1.0, top_k=2**40)
    seqs, results = run(llm, poison)
    assert all(r.error is None for r in results)
    faults = [f for r in results for f in r.faults]
    assert [(f.seq_id, f.reason) for f in faults] == [(seqs[1].seq_id, "invalid")]
    assert "top_k 1099511627776 does not fit 32 bits" in faults[0].message
    assert seqs[1].finish_reason == "error" and seqs[1].error[0] == "invalid"
    assert [tuple(s.output_token_ids) for s in (seqs[0], seqs[2])] == [alone[0], alone[2]]
    assert llm.core.kv.usage == 0.0  # (nothing leaked)


def test_a_row_whose_logits_are_not_finite_ends_only_its_request(llm, alone, monkeypatch):
    """The second prompt's logits row becomes NaN at its third draw: it ends with a
    non_finite fault, its neighbours finish exactly as alone."""
    runner = llm.engine.runner
    forward = runner.model.forward
    victim: list[int] = []
    draws = {"n": 0}

    def poisoned_forward(batch, kv):
        logits = forward(batch, kv)
        draws["n"] += 1
        if draws["n"] == 3:  # every prompt is decoding by now (one row each, victim second)
            logits[1] = math.nan
        return logits
    monkeypatch.setattr(runner.model, "forward", poisoned_forward)
    monkeypatch.setattr(runner.buckets, "sizes", ())  # (eager steps: forward is called)

    def poison(seqs):
        victim.append(seqs[1].seq_id)
    seqs, results = run(llm, poison)
    faults = [f for r in results for f in r.faults]
    assert all(r.error is None for r in results)
    assert [(f.seq_id, f.reason) for f in faults] == [(victim[0], "non_finite")]
    assert seqs[1].finish_reason == "error" and len(seqs[1].output_token_ids) == 2
    assert [tuple(s.output_token_ids) for s in (seqs[0], seqs[2])] == [alone[0], alone[2]]


def test_blame_reads_non_finite_rows_and_overflowing_parameters():
    from tinyserve.engine.running.faults import StepFaults
    from tinyserve.messages import ScheduledSeq

    def seq(i, **kw):
        params = SamplingParams(**{"max_tokens": 4, **kw.pop("params", {})})
        return ScheduledSeq(seq_id=i, token_ids=kw.pop("ids", (5,)), start_pos=3, new_blocks=(),
                            sample=True, params=params, seed=kw.pop("seed", 1), **kw)
    faults = StepFaults(vocab_size=512)
    seqs = [seq(0), seq(1, ids=(513,)), seq(2, seed=2**64), seq(3, banned=(2**64 - 1,)),
            seq(4)]
    logits = torch.zeros((5, 512))
    logits[4, 7] = math.inf
    blamed = faults.blame(seqs, (logits, seqs))
    assert {i: r for i, (r, _) in blamed.items()} == {1: "invalid", 2: "invalid", 3: "invalid",
                                                     4: "non_finite"}
    assert "token id 513 is out of the vocabulary (0-511)" in blamed[1][1]
    assert "banned token id 18446744073709551615" in blamed[3][1]
    # the blamed are left out of any plan made before the scheduler heard of them
    assert [s.seq_id for s in faults.runnable(tuple(seqs))] == [0]
