"""The Responses store's byte bound is a bound on memory: what it counts is what it keeps.

A request's free-form objects (extra keys inside ``text``, a tool's own keys) are echoed in the
stored response; held as Python objects, 3 bytes of JSON (``[]``) cost ~80 bytes of heap, so a
bound on encoded bytes held ~22x its size in RSS. Here a real server, with a small bound, is
sent responses whose ``text`` carries hundreds of thousands of empty lists, and its RSS growth
must stay near the bound.
"""

import gc
import json
import tracemalloc
from pathlib import Path

import requests

from tests.server.helpers import MODEL
from tinyserve.api.responses.store import ResponseStore

BOUND = 16 * 2**20  # --responses-store-size
PADDING = 300_000  # empty lists inside text: ~0.9 MB of JSON, ~24 MB as Python objects
REQUESTS = 30  # ~27 MB of JSON sent: the store keeps what fits in BOUND


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def padded_body() -> bytes:
    text = {"format": {"type": "text"}, "padding": [[]] * PADDING}
    return json.dumps({"model": MODEL, "input": "Hi", "max_output_tokens": 1, "text": text,
                       "temperature": 0}).encode()


def test_stored_responses_hold_no_more_memory_than_the_bound(launch):
    srv = launch("--responses-store-size", str(BOUND))
    url, body = srv.url + "/v1/responses", padded_body()
    headers = {"content-type": "application/json"}
    first = requests.post(url, data=body, headers=headers, timeout=120)  # warm every path
    assert first.status_code == 200, first.text[:300]
    before = rss_bytes(srv.proc.pid)
    ids = []
    for _ in range(REQUESTS):
        r = requests.post(url, data=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text[:300]
        ids.append(r.json()["id"])
    grown = rss_bytes(srv.proc.pid) - before
    assert grown <= BOUND * 1.5 + 50 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB for a " \
        f"{BOUND / 2**20:.0f} MiB store"
    # the newest are kept (as sent), the oldest dropped for the bound
    kept = requests.get(f"{url}/{ids[-1]}", timeout=30)
    assert kept.status_code == 200 and len(kept.json()["text"]["padding"]) == PADDING
    assert requests.get(f"{url}/{ids[0]}", timeout=30).status_code == 404


def test_the_store_holds_what_it_counts():
    """Memory the store holds (traced), with the caller's copies gone, is within its bound."""
    store = ResponseStore(max_count=100, max_bytes=100_000)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ho"}]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10):  # ~30 kB of JSON each: the store keeps the last three
            assert store.put("a", padded_response(f"resp_{i}", 10_000), messages)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.count("a") == 3
    assert held <= 100_000 * 1.2, f"the store holds {held} bytes for a 100000-byte bound"
    found = store.get("a", "resp_9")
    assert found.response == padded_response("resp_9", 10_000) and list(found.messages) == messages
    assert store.get("a", "resp_6") is None


def test_what_the_store_gives_back_is_its_own_copy():
    store = ResponseStore(max_count=10, max_bytes=10_000)
    response, messages = padded_response("resp_1", 3), [{"role": "user", "content": "Hi"}]
    store.put("a", response, messages)
    response["text"]["padding"].append([])
    messages.append({"role": "assistant", "content": "Ho"})
    store.get("a", "resp_1").response["text"]["padding"].append([])
    found = store.get("a", "resp_1")
    assert len(found.response["text"]["padding"]) == 3 and len(found.messages) == 1


def padded_response(rid: str, padding: int) -> dict:
    return {"id": rid, "object": "response",
            "text": {"format": {"type": "text"}, "padding": [[] for _ in range(padding)]}}
