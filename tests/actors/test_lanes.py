"""RequestHandle: the one writer of a lane's slot count, from admission to release.

A slot is held from ``admit`` until the handler released it and any Abort it sent has been
taken by the batcher; tokens charged and not generated go back to the tenant; a handle
released before admission saw it is admitted uncharged and aborted at once."""

import asyncio
import time

import pytest

from tinyserve.actors.admission import Admission
from tinyserve.actors.lanes import Lane, RequestHandle
from tinyserve.actors.quotas import TenantQuotas
from tinyserve.config import TenantConfig
from tinyserve.messages import Abort, Accepted, SamplingParams, Submit

TENANT = TenantConfig("t", tokens_per_minute=1000)


def _lane(capacity: int = 4) -> Lane:
    return Lane("m", asyncio.Queue(maxsize=2 * capacity + 8), capacity, 64)


def _handle(rid: int = 1) -> RequestHandle:
    return RequestHandle(rid, asyncio.Queue(maxsize=8))


def _submit(h: RequestHandle, prompt: int = 2, max_tokens: int = 4) -> Submit:
    return Submit(request_id=h.request_id, prompt_token_ids=(1,) * prompt,
                  params=SamplingParams(max_tokens=max_tokens), arrival_time=time.monotonic(),
                  handle=h, tenant="t")


def test_a_finished_request_frees_its_slot_and_refunds_what_it_did_not_use():
    lane, quotas, h = _lane(), TenantQuotas((TENANT,)), _handle()
    h.admit(lane, _submit(h, 20, 80), quotas)  # 20 prompt tokens, max_tokens 80
    assert lane.in_system() == 1 and quotas.in_flight("t") == 1
    h.generated, h.done = 30, True
    h.close()  # done: no Abort
    assert lane.batcher_inbox.empty()
    assert lane.in_system() == 0 and quotas.in_flight("t") == 0
    # charged 100; the 50 completion tokens it did not generate came back (not the prompt's)
    assert 950 <= quotas._state["t"].bucket.level < 951
    h.close()  # twice: nothing moves again
    assert lane.in_system() == 0 and quotas.in_flight("t") == 0


def test_an_aborted_request_holds_its_slot_until_the_batcher_takes_the_abort():
    lane, h = _lane(), _handle(7)
    h.admit(lane, _submit(h))
    h.close()  # the client left mid-way: one Abort, then the handler ended
    h.abort()  # (again: still one)
    assert lane.batcher_inbox.qsize() == 1
    msg = lane.batcher_inbox.get_nowait()
    assert isinstance(msg, Abort) and msg.request_id == 7 and msg.handle is h
    assert lane.in_system() == 1  # the Abort is still on its way: it counts
    msg.handle.abort_taken()
    assert lane.in_system() == 0


def test_the_abort_taken_before_the_handler_ends_still_waits_for_release():
    lane, h = _lane(), _handle()
    h.admit(lane, _submit(h))
    h.abort()
    lane.batcher_inbox.get_nowait().handle.abort_taken()
    assert lane.in_system() == 1  # the handler still holds it
    h.release()
    assert lane.in_system() == 0


def test_a_client_gone_before_admission_is_admitted_and_aborted_at_once_uncharged():
    """As before the handles: it ends as an abort in the batcher (and in the metrics), its
    slot freed once the batcher takes the Abort, its tenant charged nothing."""
    lane = _lane()
    admission = Admission([lane], tenants=(TENANT,))
    admission.ready = True
    h = _handle(3)
    msg = _submit(h)
    h.close()  # the client left while the Submit waited for admission
    assert lane.batcher_inbox.empty()  # nothing to abort yet
    assert isinstance(admission._decide([msg]), Accepted)
    submit, abort = lane.batcher_inbox.get_nowait(), lane.batcher_inbox.get_nowait()
    assert submit is msg and isinstance(abort, Abort) and abort.request_id == 3
    assert lane.in_system() == 1 and admission.quotas.in_flight("t") == 0
    abort.handle.abort_taken()
    assert lane.in_system() == 0 and admission.quotas.in_flight("t") == 0


def test_admission_admits_through_the_handle_and_answers_accepted():
    lane = _lane(capacity=1)
    admission = Admission([lane], tenants=(TENANT,))
    admission.ready = True
    first, second = _handle(1), _handle(2)
    accepted, refused = (admission._decide([_submit(h)]) for h in (first, second))
    assert first.lane is lane and isinstance(accepted, Accepted) and accepted.model == "m"
    assert lane.batcher_inbox.get_nowait().handle is first
    assert refused.status == 429 and second.lane is None  # full: capacity 1
    assert admission.quotas.in_flight("t") == 1
    first.done = True
    first.close()
    assert lane.in_system() == 0 and not lane.full and admission.quotas.in_flight("t") == 0


def test_a_request_whose_last_choice_is_refused_runs_no_choice_and_is_charged_nothing():
    """Admission decides a request's choices together: the two it placed give their slots
    and their whole charges back when the third does not fit, and nothing reaches the
    batcher."""
    lane = _lane(capacity=2)
    admission = Admission([lane], tenants=(TENANT,))
    admission.ready = True
    handles = [_handle(i) for i in (1, 2, 3)]
    refused = admission._decide([_submit(h, 20, 80) for h in handles])
    assert refused.status == 429
    assert lane.batcher_inbox.empty() and lane.in_system() == 0
    assert admission.quotas.in_flight("t") == 0
    assert admission.quotas._state["t"].bucket.level >= 999  # (refills while it runs)
    assert all(h.lane is None for h in handles)
    for h in handles:  # the handler's close moves nothing again
        h.close()
    assert lane.in_system() == 0 and admission.quotas.in_flight("t") == 0


def test_ask_answers_with_the_decision_and_a_full_inbox_is_a_429_at_once():
    async def main():
        lane = _lane(capacity=1)
        admission = Admission([lane], tenants=(TENANT,))
        admission.ready = True
        actor = asyncio.get_running_loop().create_task(admission.run())
        try:
            first = _handle(1)
            assert isinstance(await admission.ask([_submit(first)]), Accepted)
            assert first.lane is lane
            second = _handle(2)
            refused = await admission.ask([_submit(second)])
            assert refused.status == 429 and second.lane is None
        finally:
            actor.cancel()
        # the actor is gone: its inbox (capacity 1) fills, and the next ask is told at once
        admission.inbox.put_nowait(object())
        refused = await admission.ask([_submit(_handle(3))])
        assert refused.status == 429 and refused.retry_after
    asyncio.run(main())


def test_a_fault_while_deciding_leaves_no_choice_holding_a_slot():
    """Admission's own bug on a later choice: the request is answered 500 (run() does that),
    and the choices placed before it hold nothing."""
    lane = _lane()
    admission = Admission([lane], tenants=(TENANT,))
    admission.ready = True
    real, calls = admission._place, iter([False, True])

    def place(msg):
        if next(calls):
            raise RuntimeError("admission bug")
        return real(msg)
    admission._place = place
    handles = [_handle(1), _handle(2)]
    with pytest.raises(RuntimeError):
        admission._decide([_submit(h) for h in handles])
    assert lane.in_system() == 0 and admission.quotas.in_flight("t") == 0
    assert lane.batcher_inbox.empty() and all(h.lane is None for h in handles)
