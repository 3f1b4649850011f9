"""Admission actor: decides, per request, whether and where the engine takes it now.

Rules, in order: the server is unhealthy, not ready or draining -> 503; the model (the one
the API routed to) is degraded to level 2+ or down and the tenant is degradable -> its fallback
model serves it instead (if it has one that is up and fits the request); the model is down ->
503; the degradation ladder sheds the tenant's priority -> 503; the tenant is at its
concurrency limit or out of tokens for the minute -> 429 with the Retry-After its bucket needs
(``quotas.py``); the model already holds its capacity (max_num_seqs + max_waiting, or the SLO
controller's smaller limit) -> a degradable tenant spills over to the fallback if that has
room, anyone else gets 429 with Retry-After (counted: sustained refusals climb the model's
degradation ladder); else the request's handle takes a slot on that model's lane
(``lanes.py``), the Submit goes on to the model's batcher, and only then is the request told
Accepted, naming the model (so an Abort can never overtake its Submit). A request whose client
left while it waited here is decided as any other, and if admitted is aborted right behind
its Submit (no quota charged), so it ends as an abort in the metrics. Every rejection is
counted by tenant and reason, every reroute by model, fallback, tenant and reason.

The API asks; admission decides. ``ask`` takes one API request's choices (n per prompt, a
completions batch's prompts) and answers with one decision for them all: Accepted, every
choice admitted, or the Failed that refused them - then none is (the choices admitted before
the refused one give their slots and charges back). A batch no wait could ever admit (more
choices than the tenant or the model may hold, more tokens than the tenant gets a minute) is a
400 at once. ``refuse_early`` answers the same questions (and the tenant's quota as it stands)
before the API compiles a grammar, so a refused request costs no compile.

Inbox capacity: the models' capacities together (each Ask holds at least one choice). ``ask``
puts without waiting; a full inbox means at least that many requests are already ahead of
this one, so it answers 429 + Retry-After right there, exactly as the actor would. Below
capacity nobody is turned away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from tinyserve.actors.lanes import Lane
from tinyserve.actors.quotas import TenantQuotas
from tinyserve.config import TenantConfig
from tinyserve.messages import Accepted, AdmissionRejected, Ask, Failed, Rerouted, Submit

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1.0
DEGRADED_MAX_TOKENS = 128  # level 2: degradable tenants' completions are capped at this


def too_many(capacity: int) -> Failed:
    return Failed(429, f"too many requests: {capacity} are already queued or running",
                  retry_after=RETRY_AFTER_S)


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
        self.inbox: asyncio.Queue[Ask] = asyncio.Queue(maxsize=self.capacity)
        self.ready = False  # set once the models are loaded and warmed up
        self.draining = False  # set on SIGTERM

    def down_models(self) -> set[str]:
        return {name for name, lane in self.lanes.items() if lane.down}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """/ready's report from one look at the state: (serving, the body). Serving means
        ready or degraded (with the worst level and why, and each model's own)."""
        fault = self._unhealthy()
        if not self.ready:
            return False, {"status": "loading"}
        if fault:
            return False, {"status": "unhealthy", "reason": fault}
        if self.draining:
            return False, {"status": "draining"}
        models, reasons, level = {}, [], 0
        for lane in self.lanes.values():
            if lane.down:
                status, why = "down", lane.down
            else:
                status, why = ("degraded" if lane.slo.level else "ready"), lane.slo.reason
            models[lane.name] = {"status": status, "level": lane.slo.level, "reason": why}
            if status != "ready":
                level = max(level, lane.slo.level)
                reasons.append(f"{lane.name}: {status}, {why}" if len(self.lanes) > 1 else why)
        return True, {"status": "degraded" if reasons else "ready", "level": level,
                      "reason": "; ".join(reasons),
                      "down": [n for n, m in models.items() if m["status"] == "down"],
                      "models": models}

    # -- asking --------------------------------------------------------------------------------
    async def ask(self, submits: Sequence[Submit], wait: bool = False) -> Accepted | Failed:
        """One API request's choices, decided together (see the module docstring).
        ``wait``: the server's own requests wait for room in the inbox instead of a 429."""
        first = submits[0]
        if len(submits) > 1:
            refusal = self._refuse_batch(first.tenant, first.model, submits)
            if refusal is not None:
                return refusal
        msg = Ask(tuple(submits), asyncio.get_running_loop().create_future())
        if wait:
            await self.inbox.put(msg)
        else:
            try:
                self.inbox.put_nowait(msg)
            except asyncio.QueueFull:  # capacity requests are already ahead of this one
                self._emit(AdmissionRejected(first.tenant, "capacity", first.model))
                return too_many(self.capacity)
        return await msg.answer

    def refuse_early(self, tenant: str, model: str, prompts: Sequence[Sequence[int]], n: int,
                     max_tokens: int) -> Failed | None:
        """Before a request's grammar is compiled (so a throttled tenant costs no compile):
        a batch's limits, then the tenant's quota for one choice as it stands now - the
        refusal, counted as admission counts its own, or None. The choice's cost is what
        admission would charge, with a degradable tenant's completion capped where its
        model's ladder caps it; admission decides again when the request arrives."""
        if tenant not in self._tenants:
            return None  # (admission will say)
        if len(prompts) * n > 1:
            refusal = self._batch_limits(self._tenants[tenant], model, [len(p) for p in prompts],
                                         n, max_tokens)
            if refusal is not None:
                return refusal
        lane = self.lanes.get(model, self._default)
        if self._tenants[tenant].degradable and lane.slo.level >= 2:
            max_tokens = min(max_tokens, DEGRADED_MAX_TOKENS)
        refusal = self.quotas.refuse(tenant, len(prompts[0]) + max_tokens)
        if refusal is None:
            return None
        self._emit(AdmissionRejected(tenant, refusal[0], lane.name))
        return refusal[1]

    def _refuse_batch(self, tenant: str, model: str, submits: Sequence[Submit]
                      ) -> Failed | None:
        """A batch's limits, for its Submits (each prompt's first choice carries the n)."""
        if tenant not in self._tenants:
            return None
        n = submits[0].n or 1
        lengths = [len(s.prompt_token_ids) for s in submits if s.n]
        return self._batch_limits(self._tenants[tenant], model, lengths, n,
                                  submits[0].params.max_tokens)

    def _batch_limits(self, tenant: TenantConfig, model: str, prompt_lengths: list[int], n: int,
                      max_tokens: int) -> Failed | None:
        """A batch no wait could ever admit is a 400, not a 429 to retry forever: more choices
        than the tenant may run at once or the model may hold, or more tokens than the
        tenant's per-minute budget."""
        prompts, choices = len(prompt_lengths), len(prompt_lengths) * n
        lane = self.lanes.get(model, self._default)
        for limit, what in ((tenant.max_concurrent, "the tenant's max_concurrent"),
                            (lane.capacity, "the model's capacity")):
            if limit is not None and choices > limit:
                if n > 1:  # the choices of n, not (only) the prompts, are what exceeds it
                    return Failed(400, f"n: {prompts} prompt(s) x n={n} is {choices} choices, "
                                  f"more than {what} ({limit}); ask for fewer", param="n")
                return Failed(400, f"prompt: a batch of {choices} prompts is more than {what} "
                              f"({limit}); send fewer at once", param="prompt")
        cost = sum(prompt_lengths) * n + choices * max_tokens
        if tenant.tokens_per_minute is not None and cost > tenant.tokens_per_minute:
            if n > 1:
                return Failed(400, f"n: {prompts} prompt(s) x n={n} may use {cost} tokens, "
                              f"more than the tenant's {tenant.tokens_per_minute} per minute; "
                              "ask for fewer", param="n")
            return Failed(400, f"prompt: the batch may use {cost} tokens, more than the "
                          f"tenant's {tenant.tokens_per_minute} per minute", param="prompt")
        return None

    # -- deciding -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            msg = await self.inbox.get()
            try:
                decision = self._decide(msg.submits)
            except Exception:  # never lose a request silently: answer it
                log.exception("admission failed for request %d", msg.submits[0].request_id)
                decision = Failed(500, "admission failed")
            if not msg.answer.done():  # (done: its handler is gone; the handles say so)
                msg.answer.set_result(decision)

    def _decide(self, submits: Sequence[Submit]) -> Accepted | Failed:
        """Every choice placed (its handle admitted), then sent on; or, at the first refused,
        none: those placed before it are withdrawn."""
        placed: list[tuple[Lane, Submit, Lane, str]] = []
        try:
            for msg in submits:
                got = self._place(msg)
                if isinstance(got, Failed):
                    _withdraw(placed)
                    return got
                placed.append(got)
        except Exception:  # (run() answers a 500: nothing of it may keep a slot)
            _withdraw(placed)
            raise
        for lane, msg, routed, why in placed:
            lane.batcher_inbox.put_nowait(msg)  # sized for capacity: never full (lanes.py)
            if msg.handle.released:  # its client left while it waited here: end it as an abort
                msg.handle.abort()  # (right behind its Submit: counted like any other)
            if lane is not routed:
                self._emit(Rerouted(routed.name, lane.name, msg.tenant, why))
        return Accepted(placed[0][0].name)

    def _place(self, msg: Submit) -> tuple[Lane, Submit, Lane, str] | Failed:
        """Where one choice goes (lane, the Submit as it goes there, the lane it was routed
        to, why it moved), its handle admitted there; or its refusal, counted."""
        fault = self._unhealthy()
        if fault or self.draining or not (self.ready or msg.internal):  # warm-up: before ready
            why = (f"the server is unhealthy: {fault}" if fault else
                   "the server is shutting down" if self.draining else "the model is not ready")
            return Failed(503, why, retry_after=5.0)
        lane = routed = self.lanes.get(msg.model, self._default)
        refusal, why = None, ""
        if not msg.internal:
            lane, msg, why, refusal = self._degrade(lane, msg)
        cost = len(msg.prompt_token_ids) + msg.params.max_tokens
        if refusal is None and not msg.internal:
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
            return failed
        msg.handle.admit(lane, msg, None if msg.internal else self.quotas)
        return lane, msg, routed, why

    def _spill(self, lane: Lane, msg: Submit) -> tuple[Lane, Submit] | None:
        """A degradable request its model has no room for goes to the fallback, if that has
        room, fits it, and its own ladder would not shed it."""
        tenant = self._tenants[msg.tenant]
        if not tenant.degradable or lane.fallback is None or msg.adapter is not None:
            return None  # (an adapter lives on its base model: it cannot move)
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
        if why and tenant.degradable and lane.fallback is not None and msg.adapter is None:
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


def _withdraw(placed: list[tuple[Lane, Submit, Lane, str]]) -> None:
    for _, msg, _, _ in placed:
        msg.handle.withdraw()


def _capped(msg: Submit) -> Submit:
    if msg.params.max_tokens <= DEGRADED_MAX_TOKENS:
        return msg
    params = msgspec.structs.replace(msg.params, max_tokens=DEGRADED_MAX_TOKENS)
    return msgspec.structs.replace(msg, params=params)
