"""A streaming client that records what a fleet test needs to know about each answer."""

import asyncio
from dataclasses import dataclass, field

import aiohttp

from tests.server.helpers import DONE, sse_events


@dataclass
class Answer:
    status: int = 0
    text: str = ""
    usage: dict | None = None
    error: dict | None = None
    done: bool = False
    replica: str | None = None
    attempts: int = 0
    started: asyncio.Event = field(default_factory=asyncio.Event)  # first output arrived


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict,
                            answer: Answer | None = None) -> Answer:
    a = answer or Answer()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as r:
        a.status = r.status
        a.replica = r.headers.get("x-tinyserve-replica")
        a.attempts = int(r.headers.get("x-tinyserve-attempts", "0"))
        if r.status != 200:
            a.error = (await r.json()).get("error")
            return a
        async for doc in sse_events(r.content):
            if doc is DONE:
                a.done = True
                break
            if "error" in doc:
                a.error = doc["error"]
                continue
            if doc.get("usage"):
                a.usage = doc["usage"]
            for c in doc.get("choices", []):
                a.text += c.get("text", "")
                a.started.set()
    return a
