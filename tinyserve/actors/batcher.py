"""Batcher actor: owns every request's state and drives the engine step loop (one per model).

Its inbox takes Submit, Abort, AbortAll and StepResult. Each turn it applies everything
queued, and keeps the executor fed: with ``overlap`` (the default) two steps in flight, the
one running and the next, planned from what the scheduler will know once the running one
returns (its sampled tokens are placeholders the executor fills in) - so detokenizing, stop
strings, replies and metrics for one step happen while the next one computes. Continuous
batching: running decodes plus as much prefill as the token budget allows. A sequence that
finishes on a step (EOS, a stop string) is usually in the step after it too; that token is
dropped (its result is stale), as in vLLM's async scheduling.
Results come back to the same inbox, so request state is only ever touched here, on the event
loop. Each request is one ``Request`` object in ``core.requests``, keyed by the server's id.

A message that fails is logged and the actor goes on. An exception while *scheduling* is not
caught: the scheduler's state can no longer be trusted, so the task dies and the supervisor
marks the server unhealthy and answers everyone waiting.

Inbox capacity: 2 * (admission capacity) + 8. A request holds a slot on its model's lane from
admission until its handler ends and any Abort it sent has been taken from here (see
``lanes.py``), and each slot puts at most one Submit and one Abort here: at most 2 * capacity
of them, plus two StepResults, a PlanAhead or two and one AbortAll, so ``put_nowait`` from
the handles (aborts), admission and the executor never finds it full.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from tinyserve.actors.metrics import Metrics
from tinyserve.actors.replies import Replies, reply
from tinyserve.core.engine_core import EngineCore
from tinyserve.core.request import Request
from tinyserve.core.slo import SloController
from tinyserve.messages import (
    Abort,
    AbortAll,
    ConstraintFailed,
    Failed,
    FieldError,
    Output,
    PlanAhead,
    RequestFault,
    RequestFinished,
    StepFailed,
    StepPlan,
    StepResult,
    StepStats,
    Submit,
)

log = logging.getLogger(__name__)

# a request's own fault, as its client sees it: its inputs could not run (400), its adapter
# could not be read or its logits were not finite (500: the server's files, that request only)
FAULT_STATUS = {"invalid": 400, "adapter": 500, "non_finite": 500}
PLAN_AHEAD = 0.6  # plan the next step this far into the running one (of its expected time)


class Batcher:
    def __init__(self, core: EngineCore, executor_inbox, metrics: Metrics,
                 capacity: int, batch_timeout_ms: float = 0.0,
                 slo: SloController | None = None, model: str = "", overlap: bool = True,
                 stream_interval: int = 1, stream_write_rate: float = 0.0) -> None:
        self.model = model  # the served model whose requests and steps these are
        # What each request's reader is sent, and when (replies.py)
        self.replies = Replies(stream_interval, stream_write_rate)
        self.core = core
        # Fed every first token and inter-token gap; admission reads its limit and level.
        self.slo = slo or SloController(None, None, capacity)
        self._executor_inbox = executor_inbox  # the executor's: put_nowait((model, plan))
        self._metrics = metrics
        self._batch_timeout = batch_timeout_ms / 1000.0
        self.inbox: asyncio.Queue = asyncio.Queue(maxsize=2 * capacity + 8)
        # Steps handed to the executor, oldest first: with overlap, the next step is planned
        # while one runs, so the executor goes from one to the next without waiting for us.
        self._in_flight: collections.deque[StepPlan] = collections.deque()
        self._depth = 2 if overlap else 1
        # Moving averages of a step's time on the executor: decode-only steps, and the rest
        # (a prefill can take far longer than a decode; one average would time both badly).
        self._step_s = {True: 0.0, False: 0.0}
        self._ahead_due = False  # time to plan the step behind the one in flight
        self._ahead_gen = 0
        # n > 1: a request's later choices wait here until its first choice has its first
        # token, so they find the prompt in the prefix cache (one prefill). First choice's id
        # -> the Submits waiting on it; released when it has a token or ends.
        self._after: dict[int, list[Submit]] = {}

    # -- queries (snapshots for other actors) ------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self.core.requests)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if self.slo.enabled and not self.core.has_unfinished:
                try:  # an idle model's SLO windows still close (see SloController.tick)
                    msg = await asyncio.wait_for(self.inbox.get(), self.slo.window_s)
                except TimeoutError:
                    self._tick()
                    self._emit_stats(0)
                    continue
            else:
                msg = await self.inbox.get()
            self._handle(msg)
            while not self.inbox.empty():
                self._handle(self.inbox.get_nowait())
            if not self._in_flight and self.core.has_unfinished:
                await self._wait_for_company()
                if not self._in_flight and self.core.has_unfinished and self._launch():
                    self._plan_ahead_later()
            if len(self._in_flight) == 1 and self._ahead_due:
                self._ahead_due = False
                if self.core.has_unfinished:
                    self._launch()

    def _plan_ahead_later(self) -> None:
        """The step in flight has just started: plan the next one shortly before it is due
        to end (PLAN_AHEAD of its expected time), so that requests arriving meanwhile still
        make it in. Late, the executor waits a little; too early, arrivals wait a step."""
        if self._depth < 2:
            return
        self._ahead_gen += 1
        self._ahead_due = False
        gen = self._ahead_gen
        running = self._in_flight[0]
        delay = PLAN_AHEAD * self._step_s[running.num_tokens == len(running.seqs)]
        asyncio.get_running_loop().call_later(delay, self._due, gen)

    def _due(self, gen: int) -> None:
        if gen == self._ahead_gen:  # (an older timer, for a step already over, does nothing)
            self._ahead_due = True
            self.inbox.put_nowait(PlanAhead())  # wakes the loop (the inbox has room for it)

    def _handle(self, msg) -> None:
        try:
            match msg:
                case StepResult():
                    self._on_result(msg)
                    if self._in_flight:  # the step planned behind it starts now
                        self._plan_ahead_later()
                case PlanAhead():
                    pass  # (the loop looks at _ahead_due)
                case Submit():
                    self._on_submit(msg)
                case Abort():
                    if msg.handle is not None:
                        msg.handle.abort_taken()
                    self._on_abort(msg.request_id)
                case AbortAll():
                    for waiting in self._after.values():
                        for sub in waiting:
                            reply(sub.reply_to, Failed(msg.status, msg.message,
                                                       retry_after=5.0), sub.request_id)
                    self._after.clear()
                    for req in list(self.core.requests.values()):
                        self.replies.send(req, Failed(msg.status, msg.message,
                                                      retry_after=5.0))
                        self._end(req, None)
                    self._emit_stats(0)
                case _:
                    log.error("batcher: unknown message %r", msg)
        except Exception:
            log.exception("batcher: failed to handle %r", type(msg).__name__)

    async def _wait_for_company(self) -> None:
        """An idle engine given one new request may wait batch_timeout for more to arrive."""
        if not self._batch_timeout or self.core.scheduler.num_running:
            return
        deadline = time.monotonic() + self._batch_timeout
        while self.core.scheduler.num_waiting < self.core.cfg.max_num_seqs:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                msg = await asyncio.wait_for(self.inbox.get(), left)
            except TimeoutError:
                return
            self._handle(msg)
            if self._in_flight or not self.core.has_unfinished:
                return

    def _launch(self) -> bool:
        """Plan a step and hand it to the executor; False if there was nothing to plan."""
        plan = self.core.schedule()  # raises only on a bug: the supervisor handles it
        if plan is None:
            if not self._in_flight:  # (with a step in flight: all that is left is in it)
                log.error("scheduler returned no step with %d requests pending",
                          self.num_requests)
            return False
        now = time.monotonic()
        for s in plan.seqs:
            req = self.core.requests[s.seq_id]
            if req.first_scheduled is None:
                req.first_scheduled = now
        self._in_flight.append(plan)
        self._executor_inbox.put_nowait((self.model, plan))  # two slots per model: never full
        return True

    # -- messages ----------------------------------------------------------------------------
    def _on_submit(self, msg: Submit) -> None:
        first = self.core.requests.get(msg.after) if msg.after is not None else None
        if first is not None and not first.token_times and not first.seq.is_finished:
            self._after.setdefault(msg.after, []).append(msg)
            return
        self._add(msg)

    def _release_after(self, request_id: int) -> None:
        for msg in self._after.pop(request_id, ()):
            self._add(msg)

    def _add(self, msg: Submit) -> None:
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                  msg.cache_salt, msg.priority, msg.tenant,
                                  arrival_time=msg.arrival_time, internal=msg.internal,
                                  n=msg.n, adapter=msg.adapter)
        except FieldError as e:
            reply(msg.reply_to, Failed(400, str(e), param=e.field), msg.request_id)
            return
        except ValueError as e:  # (a duplicate id: a bug, but the request is still answered)
            reply(msg.reply_to, Failed(400, str(e)), msg.request_id)
            return
        self.replies.open(msg.request_id, msg.reply_to)

    def _on_abort(self, request_id: int) -> None:
        req = self.core.requests.get(request_id)
        if req is None:  # it finished first, or it is a later choice still waiting
            for first, waiting in list(self._after.items()):
                for sub in waiting:
                    if sub.request_id == request_id:
                        waiting.remove(sub)
                        reply(sub.reply_to, Output("", (), 0, finish_reason="abort"),
                              sub.request_id)
                        if not waiting:
                            del self._after[first]
                        return
            return
        self.replies.send(req, Output("", (), 0, finish_reason="abort"))
        self._end(req, "abort")
        self._emit_stats(0)

    def _on_result(self, result: StepResult) -> None:
        if not self._in_flight or self._in_flight[0].step_id != result.step_id:
            log.error("batcher: unexpected result for step %d", result.step_id)
            return
        plan = self._in_flight.popleft()
        if result.seconds > 0:
            kind = plan.num_tokens == len(plan.seqs)
            old = self._step_s[kind]
            self._step_s[kind] = 0.8 * old + 0.2 * result.seconds if old else result.seconds
        if result.error:
            log.error("step %d failed: %s", result.step_id, result.error)
            self._metrics.emit(StepFailed(self.model))
        now = time.monotonic()
        self.replies.refill(now)
        tokens = 0  # vLLM's iteration tokens: see StepStats.num_tokens
        slo = self.slo if self.slo.enabled else None
        replies, after = self.replies, self._after
        for req in self.core.process(plan, result):  # (per token: kept lean)
            seq = req.seq
            if seq.finish_reason == "error":
                if seq.error is not None:
                    self._constraint_failed(req)
                else:
                    replies.send(req, Failed(500, "the engine failed while running this "
                                             "request"))
                    self._end(req, None)
                continue
            times = req.token_times
            new = seq.num_new or 1  # (a verify's several tokens arrive together)
            if not req.internal:
                if not times:
                    tokens += len(seq.prompt_token_ids)
                    if slo is not None:
                        slo.observe(ttft=now - req.arrival_time)
                elif slo is not None:
                    slo.observe(itls=(now - times[-1],) + (0.0,) * (new - 1))
                tokens += new
            if new == 1:
                times.append(now)
            else:
                times.extend((now,) * new)
            if after and req.request_id in after:  # its prompt is in the prefix cache now
                self._release_after(req.request_id)
            replies.advanced(req)
            if seq.finish_reason is not None:  # (finished: is_finished, one call fewer)
                self._end(req, seq.finish_reason)
        replies.stepped()
        self._tick()
        self._emit_stats(tokens, result.expert_load)

    def _constraint_failed(self, req: Request) -> None:
        """Its constraints could not go on: never a normal finish (that would pass off an
        output outside them as a clean one), an error the client sees, logged and counted."""
        reason, message = req.seq.error
        log.warning("request %d ended after %d tokens: %s", req.request_id,
                    req.seq.num_output_tokens, message)
        if reason in FAULT_STATUS:  # a fault of its own (engine/running/faults.py)
            self._metrics.emit(RequestFault(self.model, reason))
            self.replies.send(req, Failed(FAULT_STATUS[reason], message))
            self._end(req, None)
            return
        self._metrics.emit(ConstraintFailed(self.model, reason))
        # The request's own constraints (its grammar, its bans) are a 4xx, as an invalid
        # body would be; only the matcher raising is the server's fault (ConstraintFailed).
        self.replies.send(req, Failed(500 if reason == "grammar_crash" else 400, message,
                          param="logit_bias" if reason == "nothing_allowed" else None))
        self._end(req, None)

    def _tick(self) -> None:
        if self.slo.tick(idle=not self.core.has_unfinished) is not None:
            sched, cfg = self.core.scheduler, self.core.cfg
            sched.max_running, sched.max_tokens_per_step = self.slo.scheduler_limits(
                cfg.max_num_seqs, cfg.max_num_batched_tokens)

    # -- endings -----------------------------------------------------------------------------
    def _end(self, req: Request, reason: str | None) -> None:
        """Forget the request (freeing its blocks) and record how it finished; None: it failed
        (the API counts the error it answered, under request_errors_total)."""
        self.core.release(req.request_id)
        self.replies.close(req)  # (anything still waiting goes out before it is forgotten)
        if req.request_id in self._after:  # it ended before its first token: they go ahead
            self._release_after(req.request_id)
        if req.internal or reason is None:
            return
        seq, arrival, times = req.seq, req.arrival_time, req.token_times
        ttft = times[0] - arrival if times else None
        itls = tuple(b - a for a, b in zip(times, times[1:]))
        self._metrics.emit(RequestFinished(
            finish_reason=reason, tenant=seq.tenant, model=self.model,
            within_slo=self.slo.met(ttft, itls) if self.slo.enabled else None,
            prompt_tokens=seq.num_prompt_tokens,
            generation_tokens=seq.num_output_tokens,
            queue_seconds=None if req.first_scheduled is None else req.first_scheduled - arrival,
            ttft_seconds=ttft, e2e_seconds=(times[-1] if times else time.monotonic()) - arrival,
            itl_seconds=itls, max_tokens=seq.params.max_tokens, n=req.n,
            adapter="" if seq.adapter is None else seq.adapter.name))

    def _emit_stats(self, num_tokens: int, expert_load: tuple | None = None) -> None:
        sched, kv = self.core.scheduler, self.core.kv
        self._metrics.emit(StepStats(
            num_tokens=num_tokens, num_running=sched.num_running, num_waiting=sched.num_waiting,
            kv_usage=kv.usage, preemptions=sched.num_preemptions,
            prompt_tokens_computed=sched.num_prompt_tokens_computed,
            prefix_queries=kv.prefix_queries, prefix_hits=kv.prefix_hits,
            slo_limit=self.slo.limit if self.slo.enabled else 0,
            degradation_level=self.slo.level, model=self.model, lora=self._lora_stats(),
            spec=None if sched.spec is None else sched.spec.totals, expert_load=expert_load))

    def _lora_stats(self) -> tuple[tuple[str, ...], tuple[str, ...], int, int] | None:
        """(adapters running, adapters waiting, slots, loads so far); None without adapters.
        O(sequences) a step, only where adapters are served."""
        sched = self.core.scheduler
        if sched.lora_slots is None:
            return None

        def names(seqs) -> tuple[str, ...]:
            return tuple(sorted({s.adapter.name for s in seqs if s.adapter is not None}))
        return (names(sched.running), names(sched.waiting), sched.lora_slots.max_loras,
                sched.lora_slots.num_loads)

