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
            async for line in r.content:
                line = line.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                events.append(json.loads(data))
            return events, done, r.headers


def completion(prompt, max_tokens=8, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def chat(content, max_tokens=8, **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, **kw}


def run(coro):
    return asyncio.run(coro)
