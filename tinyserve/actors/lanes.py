"""A served model's lane (its slots and its batcher), and the handle that holds a request's
slot from the API accepting it to release.

    api: handle = RequestHandle(id, replies)  --Ask(Submit(handle), ...)-->  admission
    admission: handle.admit(lane, msg, quotas)  takes a slot (or refuses); a handle whose
                                                reader has already gone is aborted at once;
               handle.withdraw()                its batch was refused after all: all back
    api: handle.abort()                 the reader left: one Abort(handle) to the batcher
    batcher: handle.abort_taken()       it has it
    api: handle.release()               the handler ended: unused tokens go back

A slot is held from ``admit`` until the handler has released it *and* any Abort it sent has
been taken by the batcher. These methods are the only writers of ``Lane.held``, so admission's
capacity check and the bound on the batcher's inbox (each slot puts at most one Submit and one
Abort there) rest on one count with one owner: the handle.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from tinyserve.actors.quotas import TenantQuotas
from tinyserve.actors.reply_queue import ReplyQueue
from tinyserve.core.slo import SloController
from tinyserve.messages import Abort, Submit

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Lane:
    """One served model as admission and the API see it. ``held`` moves only through
    RequestHandle; ``refused`` is admission's, ``down`` the server's (on the supervisor's
    word); the rest is fixed at startup."""

    name: str
    batcher_inbox: asyncio.Queue
    capacity: int  # max_num_seqs + max_waiting
    max_model_len: int
    slo: SloController | None = None  # the batcher's; admission reads its limit and level
    fallback: str | None = None  # --fallback: serves degradable traffic while this one cannot
    down: str | None = None  # why its steps fail; None while it serves
    held: int = 0  # slots held by handles (see the module docstring)
    refused: int = 0  # turned away for capacity (the SLO controller's overload signal)

    def __post_init__(self) -> None:
        if self.slo is None:
            self.slo = SloController(None, None, self.capacity)

    @property
    def limit(self) -> int:
        """Requests it may hold now: its capacity, or the SLO controller's smaller limit."""
        return min(self.capacity, self.slo.limit)

    @property
    def full(self) -> bool:
        return self.in_system() >= self.limit

    def in_system(self) -> int:
        """Requests holding a slot: from admission until their handler ends (a slow reader
        keeps its slot) and their Abort, if they sent one, has reached the batcher."""
        return self.held


@dataclass(eq=False)
class RequestHandle:
    """One request from the API accepting it to release: its reply queue and the slot it holds."""

    request_id: int  # the server's own id
    replies: ReplyQueue  # Accepted | Failed, then Outputs: the request's own, bounded
    lane: Lane | None = None  # set by admission: the model answering it
    generated: int = 0  # completion tokens the reader has seen (the rest is refunded)
    done: bool = False  # its final message (an Output with finish_reason, or Failed) arrived
    # admission's: (quotas, tenant, max_tokens, the cost charged: prompt + max_tokens)
    _charge: tuple = field(default=(), repr=False)
    _released: bool = False
    _abort_pending: bool = False
    _holds_slot: bool = False

    @property
    def released(self) -> bool:
        return self._released

    def admit(self, lane: Lane, msg: Submit, quotas: TenantQuotas | None = None) -> None:
        """Admission takes its Submit onto ``lane``, charging the tenant's ``quotas`` what it
        may use (prompt + max_tokens; the completion tokens it does not generate come back at
        release). A handle already released (its client left while it waited for admission)
        is charged nothing: admission aborts it right behind its Submit."""
        self.lane, self._holds_slot = lane, True
        lane.held += 1
        if quotas is not None and not self._released:
            cost = len(msg.prompt_token_ids) + msg.params.max_tokens
            quotas.admit(msg.tenant, cost)
            self._charge = (quotas, msg.tenant, msg.params.max_tokens, cost)

    def withdraw(self) -> None:
        """Admission takes its ``admit`` back (a later choice of the same request was refused,
        so none of them runs): nothing was sent yet; the slot and the whole charge return."""
        if not self._holds_slot:
            return
        if self._charge:
            quotas, tenant, _, cost = self._charge
            quotas.release(tenant, cost)
            self._charge = ()
        self._holds_slot = False
        self.lane.held -= 1
        self.lane = None

    def abort(self) -> None:
        """Stop the request wherever it is: once admitted, one Abort goes to its batcher
        (behind its Submit, which admission queued first). Before admission has seen it,
        nothing is needed: admission aborts a released handle as it admits it."""
        if self.lane is None or self._abort_pending or not self._holds_slot:
            return
        try:
            self.lane.batcher_inbox.put_nowait(Abort(self.request_id, self))
            self._abort_pending = True
        except asyncio.QueueFull:  # sized so it cannot be (see the module docstring)
            log.error("batcher inbox full: request %d could not be aborted", self.request_id)

    def abort_taken(self) -> None:
        """The batcher has taken this handle's Abort."""
        self._abort_pending = False
        self._free()

    def release(self) -> None:
        """Its handler has ended (call once, last): the tokens it was charged for and did not
        generate go back to its tenant; the slot is free once no Abort is on its way."""
        if self._released:
            return
        self._released = True
        if self._charge:
            quotas, tenant, max_tokens, _ = self._charge
            quotas.release(tenant, max(0, max_tokens - self.generated))
        self._free()

    def close(self) -> None:
        """The handler is done with it, however it ended: abort what may still run, then
        release."""
        if not self.done:
            self.abort()
        self.release()

    def _free(self) -> None:
        if self._holds_slot and self._released and not self._abort_pending:
            self._holds_slot = False
            self.lane.held -= 1
