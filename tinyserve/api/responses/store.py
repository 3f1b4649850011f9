"""The Responses API's memory: stored responses, for ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{id}``.

One least-recently-used store per tenant, each bounded by a count and by bytes: a tenant that
stores a lot evicts only its own responses, and no tenant can see another's (a lookup under
another tenant finds nothing: the API answers 404, as for an id that never existed). Ids are
the server's own (``resp_`` + 128 random bits), so one cannot be guessed. Owned by the
Responses routes; the event loop is its only user.

What is kept is what is counted: each response and its conversation as encoded JSON, decoded
again on each read. A response echoes the request's free-form objects (``text``, ``tools``), and
as Python objects their JSON grows ~25x (``[]``: 3 bytes sent, ~80 of heap). NOTE: kept as
objects, a 16 MiB bound let RSS grow 357 MiB (30 responses of 1.2 MB, ``text`` padded with
``[]``s); kept encoded, 25 MiB (tests/server/test_responses_memory.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

# What an entry costs beside its JSON (the Stored, its id, the dict slot), counted so that a
# count bound of many tiny responses is not free
ENTRY_OVERHEAD = 256


@dataclass(frozen=True, slots=True)
class Stored:
    response_json: bytes  # the Response object as GET returns it
    # the conversation up to and including this response's output, as chat messages (what a
    # follow-up renders through the chat template before its own input); instructions are not
    # kept: as OpenAI's, they do not carry over
    messages_json: bytes

    @property
    def size(self) -> int:
        """Bytes counted against the tenant's bound."""
        return len(self.response_json) + len(self.messages_json) + ENTRY_OVERHEAD

    @property
    def response(self) -> dict[str, Any]:
        return msgspec.json.decode(self.response_json)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return msgspec.json.decode(self.messages_json)


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
        stored = Stored(msgspec.json.encode(response), msgspec.json.encode(messages))
        if self.max_count == 0 or stored.size > self.max_bytes:
            return False
        store = self._tenants.setdefault(tenant, _TenantStore())
        self._drop(store, response["id"])
        store.items[response["id"]] = stored
        store.bytes += stored.size
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
