"""Admission actor: decides, per request, whether and where the engine takes it now.

Rules, in order: the server is unhealthy, not ready or draining -> 503; the model (the one
ingress routed to) is degraded to level 2+ or down and the tenant is degradable -> its fallback
model serves it instead (if it has one that is up and fits the request); the model is down ->
503; the degradation ladder sheds the tenant's priority -> 503; the tenant is at its
concurrency limit or out of tokens for the minute -> 429 with the Retry-After its bucket needs
(``quotas.py``); the model already holds its capacity (max_num_seqs + max_waiting, or the SLO
controller's smaller limit) -> a degradable tenant spills over to the fallback if that has
room, anyone else gets 429 with Retry-After (counted: sustained refusals climb the model's
degradation ladder); else the Submit goes on to that model's
batcher, and only then is the request told Accepted, naming the model (so an Abort that
ingress sends after Accepted can never overtake its Submit). Every rejection is counted by
tenant and reason, every reroute by model, fallback, tenant and reason.

Inbox capacity: the models' capacities together. Ingress puts without waiting; a full inbox
means at least that many requests are already ahead of this one, so ingress answers 429 +
Retry-After right there, exactly as this actor would. Below capacity nobody is turned away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from tinyserve.actors.quotas import TenantQuotas
from tinyserve.config import TenantConfig
from tinyserve.core.slo import SloController
from tinyserve.messages import Accepted, AdmissionRejected, Failed, Rerouted, Submit

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0
DEGRADED_MAX_TOKENS = 128  # level 2: degradable tenants' completions are capped at this


def too_many(capacity: int) -> Failed:
    return Failed(429, f"too many requests: {capacity} are already queued or running",
                  retry_after=RETRY_AFTER_S)


@dataclass(eq=False)
class Lane:
    """One served model as admission and ingress see it. Fields with one writer each:
    ``admitted``/``released`` admission, ``aborts_sent`` ingress, ``down`` the server (on the
    supervisor's word); the rest is fixed at startup."""

    name: str
    batcher_inbox: asyncio.Queue
    capacity: int  # max_num_seqs + max_waiting
    max_model_len: int
    aborts_received: Callable[[], int] = lambda: 0  # the batcher's count
    slo: SloController | None = None  # the batcher's; admission reads its limit and level
    fallback: str | None = None  # --fallback: serves degradable traffic while this one cannot
    down: str | None = None  # why its steps fail; None while it serves
    admitted: int = 0
    released: int = 0
    refused: int = 0  # turned away for capacity (the SLO controller's overload signal)
    aborts_sent: int = 0

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
        """Requests holding a slot, from acceptance until their handler ends (a slow reader
        keeps its slot), plus Aborts still on their way to the batcher.

        Each slot puts at most one Submit and one Abort in the batcher's inbox, and an Abort
        keeps counting until the batcher takes it, so that inbox never holds more than about
        2 * capacity messages (its size: see the batcher).
        """
        return self.admitted - self.released + self.aborts_sent - self.aborts_received()


class Admission:
    def __init__(self, lanes: Sequence[Lane], unhealthy: Callable[[], str | None] = lambda: None,
                 tenants: tuple[TenantConfig, ...] = (TenantConfig("default"),),
                 emit: Callable[[AdmissionRejected | Rerouted], None] = lambda event: None
                 ) -> None:
        self.lanes = {lane.name: lane for lane in lanes}
        self._default = lanes[0]  # a Submit naming no model
        self.quotas = TenantQuotas(tenants)
        self._tenants = {t.name: t for t in tenants}
        self._lowest = min(t.priority for t in tenants)
        self._highest = max(t.priority for t in tenants)
        self._emit = emit
        self._unhealthy = unhealthy  # the supervisor's verdict: None, or why not
        self.capacity = sum(lane.capacity for lane in lanes)
        self.inbox: asyncio.Queue[Submit] = asyncio.Queue(maxsize=self.capacity)
        self.ready = False  # set once the models are loaded and warmed up
        self.draining = False  # set on SIGTERM
        # id -> (its lane, tenant charged or None, max_tokens charged)
        self._held: dict[int, tuple[Lane, str | None, int]] = {}

    def release(self, request_id: int, generated: int = 0) -> None:
        """An accepted request is over for good: its HTTP handler has ended (so its reply
        queue is gone too); the completion tokens it was charged for and did not generate go
        back to its tenant's bucket. Called by ingress (and by the server for its warm-up)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        lane, tenant, max_tokens = held
        lane.released += 1
        if tenant is not None:
            self.quotas.release(tenant, max(0, max_tokens - generated))

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
        lane = routed = self.lanes.get(msg.model, self._default)
        refusal, why = None, ""
        if not msg.internal:
            lane, msg, why, refusal = self._degrade(lane, msg)
        if refusal is None and not msg.internal:
            cost = len(msg.prompt_token_ids) + msg.params.max_tokens
            refusal = self.quotas.refuse(msg.tenant, cost)
        if refusal is None and lane.full:
            spill = None if msg.internal or lane is not routed else self._spill(lane, msg)
            if spill is not None:
                lane, msg, why = *spill, "overload"
            else:
                lane.refused += 1
                refusal = "capacity", too_many(lane.limit)
        if refusal is not None:
            reason, failed = refusal
            self._emit(AdmissionRejected(msg.tenant, reason, lane.name))
            msg.reply_to.put_nowait(failed)
            return
        lane.batcher_inbox.put_nowait(msg)  # sized for capacity: never full (see in_system)
        lane.admitted += 1
        tenant = None if msg.internal else msg.tenant
        if tenant is not None:
            self.quotas.admit(tenant, len(msg.prompt_token_ids) + msg.params.max_tokens)
        if lane is not routed:
            self._emit(Rerouted(routed.name, lane.name, msg.tenant, why))
        self._held[msg.request_id] = (lane, tenant, msg.params.max_tokens)
        msg.reply_to.put_nowait(Accepted(lane.name))

    def lane_of(self, request_id: int) -> Lane | None:
        """The model an accepted request is on (until it is released)."""
        held = self._held.get(request_id)
        return None if held is None else held[0]

    def _spill(self, lane: Lane, msg: Submit) -> tuple[Lane, Submit] | None:
        """A degradable request its model has no room for goes to the fallback, if that has
        room, fits it, and its own ladder would not shed it."""
        tenant = self._tenants[msg.tenant]
        if not tenant.degradable or lane.fallback is None:
            return None
        other = self.lanes[lane.fallback]
        if other.slo.level >= 2:  # the fallback's own ladder caps degradable tenants
            msg = _capped(msg)
        if (other.down or other.full or self._shed(other, tenant)
                or len(msg.prompt_token_ids) + msg.params.max_tokens > other.max_model_len):
            return None
        return other, msgspec.structs.replace(msg, model=other.name)

    def _shed(self, lane: Lane, tenant: TenantConfig) -> bool:
        level = lane.slo.level
        return bool(level) and ((level >= 3 and tenant.priority < self._highest) or (
            tenant.priority == self._lowest < self._highest))

    def _degrade(self, lane: Lane, msg: Submit
                 ) -> tuple[Lane, Submit, str, tuple[str, Failed] | None]:
        """Fallback and the degradation ladder (see core/slo.py): a degradable tenant leaves a
        model that is down, degraded to level 2+, or would shed it, for the fallback when that
        can take it (up, room, fits, would not shed it); then shed by priority, and cap
        degradable tenants' completions at level 2+ (of the model that serves them)."""
        tenant = self._tenants[msg.tenant]
        why = ("down" if lane.down else "degraded" if lane.slo.level >= 2 or self._shed(
            lane, tenant) else "")
        if why and tenant.degradable and lane.fallback is not None:
            other = self.lanes[lane.fallback]
            moved = _capped(msg) if lane.slo.level >= 2 or other.slo.level >= 2 else msg
            if (other.down is None and not other.full and not self._shed(other, tenant) and
                    len(moved.prompt_token_ids) + moved.params.max_tokens <= other.max_model_len):
                return other, msgspec.structs.replace(moved, model=other.name), why, None
        if lane.down:
            return lane, msg, why, ("unavailable", Failed(
                503, f"the model {lane.name} is unavailable ({lane.down})", retry_after=5.0))
        if self._shed(lane, tenant):
            return lane, msg, why, ("degraded", Failed(
                503, f"the server is degraded ({lane.slo.reason}): priority {tenant.priority} "
                "requests are shed for now", retry_after=5.0))
        capped = tenant.degradable and lane.slo.level >= 2
        return lane, (_capped(msg) if capped else msg), why, None


def _capped(msg: Submit) -> Submit:
    if msg.params.max_tokens <= DEGRADED_MAX_TOKENS:
        return msg
    params = msgspec.structs.replace(msg.params, max_tokens=DEGRADED_MAX_TOKENS)
    return msgspec.structs.replace(msg, params=params)
