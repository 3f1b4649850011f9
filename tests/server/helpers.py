"""Small HTTP helpers for the server tests (aiohttp client, no extra dependencies)."""

import asyncio
import json

import aiohttp

MODEL = "stories260k"


async def post(url: str, path: str, body, headers: dict | None = None, raw: bool = False):
    """-> (status, json body or text, headers)."""
    async with aiohttp.ClientSession() as s:
        data = body if raw else json.dumps(body)
        async with s.post(url + path, data=data, headers={
                "Content-Type": "application/json", **(headers or {})}) as r:
            text = await r.text()
            try:
                payload = json.loads(text)
            except ValueError:
                payload = text
            return r.status, payload, r.headers


async def stream(url: str, path: str, body, headers: dict | None = None):
    """-> (list of parsed SSE data payloads, '[DONE]' seen, response headers)."""
    events, done = [], False
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json={**body, "stream": True}, headers=headers) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for doc in sse_events(r.content):
                if doc is DONE:
                    done = True
                    break
                events.append(doc)
            return events, done, r.headers


DONE = object()  # what sse_events yields for `data: [DONE]`


async def sse_events(content):
    """The parsed `data:` payloads of an SSE body, DONE for `[DONE]`."""
    async for line in content:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield DONE if data == "[DONE]" else json.loads(data)


def completion(prompt, max_tokens=8, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def chat(content, max_tokens=8, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **kw}


def run(coro):
    return asyncio.run(coro)
