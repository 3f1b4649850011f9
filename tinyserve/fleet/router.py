"""Ray Serve request router for the fleet: Ray's prefix tree (the one behind Ray Serve LLM's
PrefixCacheAffinityRouter) for which replica saw which prompt, our policy (policy.py) for the
choice, and three fixes that matter under bursts of streaming requests:

- the replica chosen for a request is given to *that* request: Ray's base router hands a
  chosen replica to the oldest pending request, which under concurrency sends one prefix's
  request to another prefix's replica;
- prefix-tree calls are awaited, not ``ray.get``-blocked inside the ingress's event loop;
- a retry's ``exclude`` list and replicas' readiness are honoured.
"""

from __future__ import annotations

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

from tinyserve.fleet.messages import FleetRequest
from tinyserve.fleet.policy import LoadGuard, ReplicaLoad, rank


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
        super().initialize_state(**kwargs)
        self._guard = LoadGuard(balance_abs_threshold, balance_rel_threshold, kv_high)
        self._routing: dict[str, PendingRequest] = {}  # internal request id -> request
        self._claimed: dict[str, str] = {}  # internal request id -> replica it was claimed for
        self._routed: Counter[str] = Counter()  # replica -> requests ranked first (tie-break)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica is ranked
            self._remember(pending_request)
        req = _fleet_request(pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {i: ReplicaLoad.from_stats(r.routing_stats) for i, r in by_id.items()}
        exclude = req.exclude if req is not None else ()
        owners: list[str] = []
        text = req.prompt if req is not None else ""
        if text:
            full = {r.replica_id.to_full_id_str(): i for i, r in by_id.items()
                    if i not in exclude}
            matched, tenants = await self._tree_actor.prefix_match.remote(text, list(full))
            if tenants and len(matched) >= self._match_rate_threshold * len(text):
                owners = [full[t] for t in tenants if t in full]
            else:  # nobody has it: the replicas whose trees hold least
                smallest = await self._tree_actor.get_smallest_tenants.remote() or []
                owners = [full[t] for t in smallest if t in full]
        ranks = rank(list(by_id), loads, owners, self._guard, exclude, self._routed)
        if ranks:
            self._routed[ranks[0][0]] += 1
        if text and ranks and pending_request is not None:
            # Claim the prefix now, as SGLang's router does: a burst of one new prefix then
            # follows its first request instead of spreading before that one is routed.
            first = by_id[ranks[0][0]].replica_id.to_full_id_str()
            self._claimed[pending_request.metadata.internal_request_id] = first
            self._tree_actor.insert.remote(text, first, time.time())
        return [[by_id[i] for i in ids] for ids in ranks]

    def _remember(self, pr: PendingRequest) -> None:
        rid = pr.metadata.internal_request_id
        if rid not in self._routing and len(self._routing) > 4096:
            for k in [k for k, v in self._routing.items() if v.future.done()]:
                del self._routing[k]
                self._claimed.pop(k, None)
        self._routing[rid] = pr

    def _get_pending_request_matching_metadata(self, request_metadata=None):
        if request_metadata is not None:
            pr = self._routing.pop(request_metadata.internal_request_id, None)
            if pr is not None and not pr.future.done():
                return pr
        return super()._get_pending_request_matching_metadata(request_metadata)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        req = _fleet_request(pending_request)
        full = replica_id.to_full_id_str()
        claimed = self._claimed.pop(pending_request.metadata.internal_request_id, None)
        if req is not None and req.prompt and claimed != full:
            # Fire and forget: the tree actor runs one caller's calls in order.
            self._tree_actor.insert.remote(req.prompt, full, time.time())
