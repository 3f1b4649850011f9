"""Speculation in the scheduler (no model): the n-gram index, verify entries, how far a
verify advances a sequence, and that nothing of a rejected draft survives - the fake
executor checks every position a step reads holds the fingerprint of that sequence's own
tokens, and the prefix hashes equal those of the same tokens decoded one at a time."""

import pytest

from tests.core.test_scheduler import (
    EOS,
    VOCAB,
    FakeExecutor,
    create_requests,
    fingerprint,
    make_scheduler,
    run,
)
from tinyserve.cli.values import parse_speculative_config
from tinyserve.config import SpeculativeConfig
from tinyserve.core.scheduler import Scheduler, SchedulerConfig
from tinyserve.core.spec_state import Acceptance, NgramIndex
from tinyserve.messages import SeqOutput, StepPlan, StepResult


def test_ngram_index_proposes_what_followed_the_latest_match():
    idx = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert idx.propose(tokens, 3) == (4, 9, 9)  # "1 2 3" ended at index 2
    tokens += [5, 1, 2]
    assert idx.propose(tokens, 2) == (3, 5)  # the latest "1 2" (at 6-7) wins over 0-1
    assert idx.propose([7, 8], 4) == ()  # (a fresh index: nothing repeats)
    assert NgramIndex(2, 4).propose([5, 6, 7, 5, 6], 10) == (7, 5, 6)  # as far as known


def test_config_refuses_what_it_does_not_do_by_name():
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig(num_speculative_tokens=3)
    for text, match in [('{"method": "eagle"}', "trained head"), ('{"method": "mtp"}', "head"),
                        ('{"method": "draft_model"}', "checkpoint"),
                        ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                        ('{"speculative_model": "x"}', "unknown keys"), ("[1]", "object")]:
        with pytest.raises(ValueError, match=match):
            parse_speculative_config(text)


def test_acceptance_stops_a_request_that_is_never_accepted():
    a = Acceptance()
    for _ in range(3):
        a.record(0, 4)
    assert a.worth_it(0.1)  # (a few steps before judging)
    for _ in range(5):
        a.record(0, 4)
    assert not a.worth_it(0.1)


class SpecExecutor(FakeExecutor):
    """FakeExecutor's KV checks, with a model that copies: the next token is what followed
    the last token's previous occurrence (else a hash of the tokens so far), so the n-gram
    proposer is often right and sometimes wrong. A verify draws at every position, and a
    draft is accepted exactly when it is what plain decoding would have drawn there."""

    def execute(self, plan: StepPlan, only=None) -> StepResult:
        self.apply_tables(plan)
        outs = []
        for s in plan.seqs:
            toks = self.tokens_by_seq[s.seq_id]
            table = self.tables[s.seq_id]
            for p in range(s.start_pos):  # reads: its own context only
                slot = table[p // self.bs] * self.bs + p % self.bs
                assert self.kv.get(slot) == fingerprint(toks[: p + 1]), (s.seq_id, p)
            seen = list(toks[: s.start_pos]) + list(s.token_ids)
            assert list(s.token_ids[:1]) == toks[s.start_pos:s.start_pos + 1]
            draws = []
            for i in range(len(s.token_ids)):  # writes (a verify's drafts too)
                p = s.start_pos + i
                slot = table[p // self.bs] * self.bs + p % self.bs
                self.kv[slot] = fingerprint(seen[: p + 1])
                draws.append(copy_model(seen[: p + 1]))
            if not s.sample:
                continue
            if not s.num_drafts:
                outs.append(SeqOutput(s.seq_id, draws[-1], 0.0))
                continue
            j = next((i for i in range(s.num_drafts) if draws[i] != s.token_ids[i + 1]),
                     s.num_drafts)
            outs.append(SeqOutput(s.seq_id, draws[0], 0.0,
                                  more=tuple((t, 0.0, None) for t in draws[1:j + 1])))
        return StepResult(plan.step_id, tuple(outs))


def copy_model(tokens: list[int]) -> int:
    last = tokens[-1]
    for k in range(len(tokens) - 2, -1, -1):
        if tokens[k] == last:
            nxt = tokens[k + 1]
            # (now and then something new, so drafts are also rejected)
            return nxt if int.from_bytes(fingerprint(tokens), "big") % 5 else (nxt * 7 + 1) % 900
    return int.from_bytes(fingerprint(tokens), "big") % (VOCAB - 1)


def spec_scheduler(spec: SpeculativeConfig | None, **kw):
    sched, _ = make_scheduler(**kw)
    cfg = SchedulerConfig(sched.cfg.max_num_seqs, sched.cfg.max_num_batched_tokens,
                          sched.cfg.max_model_len, sched.cfg.eos_token_ids, speculative=spec)
    return Scheduler(cfg, sched.kv), SpecExecutor(sched.kv.block_size)


def repetitive(n: int, max_tokens: int, start_id: int = 0):
    """Prompts that repeat, so the n-gram proposer has something to propose."""
    seqs = create_requests(n, 1, max_tokens=max_tokens, start_id=start_id)
    for i, s in enumerate(seqs):
        s.prompt_token_ids = tuple([3 + i, 4, 5, 6, 7] * 4)
        s.token_ids = list(s.prompt_token_ids)
    return seqs


@pytest.mark.parametrize("blocks", [256, 18])  # roomy, and a pool that preempts
def test_speculation_changes_nothing_and_no_rejected_draft_survives(blocks):
    plain_sched, plain_ex = spec_scheduler(None, num_blocks=256, max_model_len=64)
    want = repetitive(6, 20)
    run(plain_sched, plain_ex, want)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                             disable_by_batch_size=8)
    sched, ex = spec_scheduler(spec, num_blocks=blocks, max_model_len=64, budget=64)
    got = repetitive(6, 20)
    verify_steps = []

    final = {s.seq_id: s.token_ids for s in want}

    def on_step(plan):
        verify_steps.extend(s for s in plan.seqs if s.num_drafts)
        for s in got:  # committed (hashed) blocks hold the sequence's true tokens only
            n = s.num_committed_blocks * 4
            assert s.token_ids[:n] == final[s.seq_id][:n]
            assert s.num_computed_tokens <= len(s.token_ids)
    run(sched, ex, got, on_step=on_step)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert verify_steps and sched.spec.num_accepted > 0  # it did speculate and accept
    assert sched.spec.num_accepted < sched.spec.num_draft_tokens  # and reject, too
    if blocks == 14:
        assert sched.num_preemptions > 0


def test_no_speculation_above_the_batch_size_limit():
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                             disable_by_batch_size=2)
    sched, ex = spec_scheduler(spec, num_blocks=256)
    seqs = repetitive(3, 6) + repetitive(2, 30, start_id=3)  # two outlive the others
    sizes = []
    run(sched, ex, seqs, on_step=lambda plan: sizes.append(
        (len(sched.running), sum(1 for s in plan.seqs if s.num_drafts))))
    assert all(v == 0 for n, v in sizes if n > 2)
    assert any(v for n, v in sizes if n <= 2)  # the last ones speculate


def test_a_verify_cut_by_max_tokens_or_a_stop_token_keeps_only_its_tokens():
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    sched, ex = spec_scheduler(spec, num_blocks=256)
    seqs = repetitive(2, 7)
    run(sched, ex, seqs)
    assert all(s.num_output_tokens == 7 and s.finish_reason == "length" for s in seqs)
    assert EOS not in seqs[0].output_token_ids
