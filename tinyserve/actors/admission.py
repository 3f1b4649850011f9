"""Admission actor: decides, per request, whether the engine takes it now.

Rules, in order: the server is unhealthy, not ready or draining -> 503; the tenant is at its
concurrency limit or out of tokens for the minute -> 429 with the Retry-After its bucket needs
(``quotas.py``); the engine already holds max_num_seqs + max_waiting requests -> 429 with
Retry-After; else the Submit goes on to the batcher, and only then is the request told
Accepted (so an Abort that ingress sends after Accepted can never overtake its Submit).
Every rejection is counted by tenant and reason.

Inbox capacity: ``capacity`` (max_num_seqs + max_waiting). Ingress puts without waiting; a
full inbox means at least ``capacity`` requests are already ahead of this one, so ingress
answers 429 + Retry-After right there, exactly as this actor would. Below capacity nobody is
turned away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from tinyserve.actors.quotas import TenantQuotas
from tinyserve.config import TenantConfig
from tinyserve.core.slo import SloController
from tinyserve.messages import Accepted, AdmissionRejected, Failed, Submit

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0
DEGRADED_MAX_TOKENS = 128  # level 2: degradable tenants' completions are capped at this


def too_many(capacity: int) -> Failed:
    return Failed(429, f"too many requests: {capacity} are already queued or running",
                  retry_after=RETRY_AFTER_S)


class Admission:
    def __init__(self, batcher_inbox: asyncio.Queue, pending_aborts: Callable[[], int],
                 capacity: int, unhealthy: Callable[[], str | None] = lambda: None,
                 tenants: tuple[TenantConfig, ...] = (TenantConfig("default"),),
                 emit: Callable[[AdmissionRejected], None] = lambda event: None,
                 slo: SloController | None = None) -> None:
        self._batcher_inbox = batcher_inbox
        self.quotas = TenantQuotas(tenants)
        self._tenants = {t.name: t for t in tenants}
        self._lowest = min(t.priority for t in tenants)
        self._highest = max(t.priority for t in tenants)
        self.slo = slo or SloController(None, None, capacity)  # read only: the batcher's
        self._emit = emit
        self._pending_aborts = pending_aborts  # Aborts sent but not yet taken by the batcher
        self._unhealthy = unhealthy  # the supervisor's verdict: None, or why not
        self.capacity = capacity
        self.inbox: asyncio.Queue[Submit] = asyncio.Queue(maxsize=capacity)
        self.ready = False  # set once the model is loaded and warmed up
        self.draining = False  # set on SIGTERM
        self.num_admitted = 0
        self.num_released = 0
        self._charged: dict[int, tuple[str, int]] = {}  # id -> (tenant, max_tokens charged)

    def release(self, request_id: int, generated: int = 0) -> None:
        """An accepted request is over for good: its HTTP handler has ended (so its reply
        queue is gone too); the completion tokens it was charged for and did not generate go
        back to its tenant's bucket. Called by ingress (and by the server for its warm-up)."""
        self.num_released += 1
        charged = self._charged.pop(request_id, None)
        if charged is not None:
            tenant, max_tokens = charged
            self.quotas.release(tenant, max(0, max_tokens - generated))

    def in_system(self) -> int:
        """Requests holding a slot, from acceptance until their handler ends (a slow reader
        keeps its slot), plus Aborts still on their way to the batcher.

        Each slot puts at most one Submit and one Abort in the batcher's inbox, and an Abort
        keeps counting until the batcher takes it, so that inbox never holds more than about
        2 * capacity messages (its size: see the batcher).
        """
        return self.num_admitted - self.num_released + self._pending_aborts()

    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                self._admit(msg)
            except Exception:  # never lose a request silently: answer it
                log.exception("admission failed for request %d", msg.request_id)
                msg.reply_to.put_nowait(Failed(500, "admission failed"))

    def _admit(self, msg: Submit) -> None:
        fault = self._unhealthy()
        if fault or self.draining or not (self.ready or msg.internal):  # warm-up: before ready
            why = (f"the server is unhealthy: {fault}" if fault else
                   "the server is shutting down" if self.draining else "the model is not ready")
            msg.reply_to.put_nowait(Failed(503, why, retry_after=5.0))
            return
        refusal = None
        if not msg.internal:
            msg, refusal = self._degrade(msg)
        cost = len(msg.prompt_token_ids) + msg.params.max_tokens
        if refusal is None and not msg.internal:
            refusal = self.quotas.refuse(msg.tenant, cost)
        limit = min(self.capacity, self.slo.limit)
        if refusal is None and self.in_system() >= limit:
            refusal = "capacity", too_many(limit)
        if refusal is not None:
            reason, failed = refusal
            self._emit(AdmissionRejected(msg.tenant, reason))
            msg.reply_to.put_nowait(failed)
            return
        self._batcher_inbox.put_nowait(msg)  # sized for capacity: never full (see in_system)
        self.num_admitted += 1
        if not msg.internal:
            self.quotas.admit(msg.tenant, cost)
            self._charged[msg.request_id] = (msg.tenant, msg.params.max_tokens)
        msg.reply_to.put_nowait(Accepted())

    def _degrade(self, msg: Submit) -> tuple[Submit, tuple[str, Failed] | None]:
        """The degradation ladder (see core/slo.py): shed by priority, cap degradable tenants."""
        level = self.slo.level
        if not level:
            return msg, None
        tenant = self._tenants[msg.tenant]
        shed = (level >= 3 and tenant.priority < self._highest) or (
            tenant.priority == self._lowest < self._highest)
        if shed:
            return msg, ("degraded", Failed(
                503, f"the server is degraded ({self.slo.reason}): priority {tenant.priority} "
                "requests are shed for now", retry_after=5.0))
        if level >= 2 and tenant.degradable and msg.params.max_tokens > DEGRADED_MAX_TOKENS:
            params = msgspec.structs.replace(msg.params, max_tokens=DEGRADED_MAX_TOKENS)
            msg = msgspec.structs.replace(msg, params=params)
        return msg, None
