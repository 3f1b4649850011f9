"""Ray Serve request router for the fleet: Ray's prefix tree (the actor behind Ray Serve
LLM's PrefixCacheAffinityRouter) remembers which replica saw which prompt text; our policy
(policy.py) makes the choice. Differences from Ray's router that matter here:

- a new prefix is claimed for its replica when it is ranked, once per request, so a burst of
  one new prefix follows its first request instead of scattering before that one is routed;
- no ``ray.get`` inside the ingress's event loop: tree calls are awaited with a timeout or
  sent without waiting (one caller's calls run in order on the actor), and a tree that
  stops answering degrades routing to load only instead of failing requests;
- a retry's ``exclude`` list and the replicas' readiness are honoured;
- the tree is trimmed (LRU) per replica, so it stays bounded and forgets old prompts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica

from tinyserve.fleet.policy import LoadGuard, ReplicaLoad, prefix_counts, rank
from tinyserve.fleet.relay import FleetRequest

log = logging.getLogger("ray.serve")

TREE_TIMEOUT_S = 2.0


def _fleet_request(pr: PendingRequest | None) -> FleetRequest | None:
    if pr is None:
        return None
    for arg in pr.args or ():
        if isinstance(arg, FleetRequest):
            return arg
    return None


class PrefixLoadRouter(PrefixCacheAffinityRouter):
    def initialize_state(self, balance_abs_threshold: float = 32.0,
                         balance_rel_threshold: float = 1.5, kv_high: float = 0.95,
                         **kwargs: Any) -> None:
        kwargs.setdefault("do_eviction", True)
        super().initialize_state(**kwargs)
        self._guard = LoadGuard(balance_abs_threshold, balance_rel_threshold, kv_high)
        self._claimed: dict[str, str] = {}  # internal request id -> replica it was claimed for
        self._picked: Counter[str] = Counter()  # replica -> requests claimed for it (ties)
        self._tree_ok = True

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica is ranked
        req = _fleet_request(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {i: ReplicaLoad.from_stats(r.routing_stats) for i, r in by_id.items()}
        exclude = req.exclude if req is not None else ()
        text = req.prompt if req is not None else ""
        owners = await self._owners(text, by_id, exclude) if text else []
        ranks = rank(list(by_id), loads, owners, self._guard, exclude, self._picked)
        rid = pending_request.metadata.internal_request_id if pending_request else None
        if text and ranks and rid is not None and rid not in self._claimed:
            first = by_id[ranks[0][0]].replica_id.to_full_id_str()
            self._claimed[rid] = first
            self._picked[ranks[0][0]] += 1
            self._tree_call("insert", text, first, time.time())
        return [[by_id[i] for i in ids] for ids in ranks]

    async def _owners(self, text: str, by_id: dict[str, RunningReplica],
                      exclude: tuple[str, ...]) -> list[str]:
        """Replicas holding the longest prefix of ``text`` (at least the match-rate threshold),
        else the ones whose trees hold least; [] when the tree does not answer."""
        full = {r.replica_id.to_full_id_str(): i for i, r in by_id.items() if i not in exclude}
        try:
            async with asyncio.timeout(TREE_TIMEOUT_S):
                matched, tenants = await self._tree_actor.prefix_match.remote(text, list(full))
                if not (tenants and prefix_counts(len(matched), text,
                                                  self._match_rate_threshold)):
                    tenants = await self._tree_actor.get_smallest_tenants.remote() or []
        except Exception as e:  # an actor that died or hangs: route on load alone
            if self._tree_ok:
                log.warning("prefix tree unavailable (%s: %s): routing on load only",
                            type(e).__name__, e)
            self._tree_ok = False
            return []
        self._tree_ok = True
        return [full[t] for t in tenants if t in full]

    def _tree_call(self, method: str, *args: Any) -> None:
        """Fire and forget; a failure is logged by Ray, never raised into routing."""
        try:
            getattr(self._tree_actor, method).remote(*args)
        except Exception as e:  # the actor handle itself is unusable
            log.warning("prefix tree %s failed: %s", method, e)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        req = _fleet_request(pending_request)
        full = replica_id.to_full_id_str()
        claimed = self._claimed.pop(pending_request.metadata.internal_request_id, None)
        if len(self._claimed) > 10_000:  # requests cancelled before routing left claims
            self._claimed.clear()
        if req is not None and req.prompt and claimed != full:
            self._tree_call("insert", req.prompt, full, time.time())

    # Ray's versions of these block the event loop on the tree actor (ray.get).
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        old = set(self._replica_id_set)
        super(PrefixCacheAffinityRouter, self).update_replicas(replicas)
        new = set(self._replica_id_set)
        if added := [r.to_full_id_str() for r in new - old]:
            self._tree_call("add_tenants", added, time.time())
        if removed := [r.to_full_id_str() for r in old - new]:
            self._tree_call("remove_tenants", removed)
            for r in old - new:
                self._picked.pop(r.unique_id, None)
        if self._do_eviction and not self._eviction_loop_running:
            self._tree_call("start_eviction_loop", self._eviction_threshold_chars,
                            self._eviction_target_chars, self._eviction_interval_secs)
            self._eviction_loop_running = True

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super(PrefixCacheAffinityRouter, self).on_replica_actor_died(replica_id)
        self._tree_call("remove_tenants", [replica_id.to_full_id_str()])
