"""The Responses API's memory: stored responses, for ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{id}``.

One least-recently-used store per tenant, each bounded by a count and by bytes (the encoded
response and conversation): a tenant that stores a lot evicts only its own responses, and no
tenant can see another's (a lookup under another tenant finds nothing: the API answers 404, as
for an id that never existed). Ids are the server's own (``resp_`` + 128 random bits), so one
cannot be guessed. Owned by the Responses routes; the event loop is its only user.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]  # the Response object as GET returns it
    # the conversation up to and including this response's output, as chat messages (what a
    # follow-up renders through the chat template before its own input); instructions are not
    # kept: as OpenAI's, they do not carry over
    messages: tuple[dict[str, Any], ...]
    size: int  # bytes counted against the tenant's bound


class _TenantStore:
    __slots__ = ("items", "bytes")

    def __init__(self) -> None:
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._tenants: dict[str, _TenantStore] = {}
        self.evicted = 0  # responses dropped for the bounds (all tenants)

    def put(self, tenant: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> bool:
        """Keep a response (the newest); False when it alone is over the byte bound."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(messages))
        if self.max_count == 0 or size > self.max_bytes:
            return False
        store = self._tenants.setdefault(tenant, _TenantStore())
        self._drop(store, response["id"])
        store.items[response["id"]] = Stored(response, tuple(messages), size)
        store.bytes += size
        while len(store.items) > self.max_count or store.bytes > self.max_bytes:
            _, old = store.items.popitem(last=False)
            store.bytes -= old.size
            self.evicted += 1
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        store = self._tenants.get(tenant)
        found = store.items.get(response_id) if store is not None else None
        if found is not None:
            store.items.move_to_end(response_id)  # read: recently used
        return found

    def delete(self, tenant: str, response_id: str) -> bool:
        store = self._tenants.get(tenant)
        return store is not None and self._drop(store, response_id)

    def count(self, tenant: str) -> int:
        store = self._tenants.get(tenant)
        return len(store.items) if store is not None else 0

    @staticmethod
    def _drop(store: _TenantStore, response_id: str) -> bool:
        old = store.items.pop(response_id, None)
        if old is None:
            return False
        store.bytes -= old.size
        return True
