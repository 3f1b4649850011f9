"""Locust load test for tinyserve's OpenAI-compatible API.

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 60s --host http://127.0.0.1:8000

Two users: a streaming chat user and a (non-streaming) completions user. Besides the HTTP
entries (for a stream Locust times the response headers), each reports its own entries:
"TTFT" (ms to the first streamed token), "E2E" (ms to the end of the stream) and "TOKENS"
(generated tokens per request: in that row the "response time" columns are token counts).
Set TINYSERVE_MODEL if the model name should not be discovered from /v1/models, and
TINYSERVE_API_KEY for a keyed server.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

PROMPTS = [
    "Once upon a time, there was a little dog",
    "Tom and Sue went to the park to play with",
    "The sun was hot and the bird",
    "Lily had a red ball. One day",
]
MAX_TOKENS = int(os.environ.get("TINYSERVE_MAX_TOKENS", "32"))


class _Base(HttpUser):
    abstract = True
    wait_time = between(0.1, 0.5)
    model: str | None = None

    def on_start(self) -> None:
        key = os.environ.get("TINYSERVE_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"
        if _Base.model is None:
            _Base.model = os.environ.get("TINYSERVE_MODEL") or \
                self.client.get("/v1/models").json()["data"][0]["id"]

    def _report(self, kind: str, name: str, value: float) -> None:
        events.request.fire(request_type=kind, name=name, response_time=value,
                            response_length=0, exception=None, context={})


class StreamingChatUser(_Base):
    weight = 3

    @task
    def chat_stream(self) -> None:
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.8,
                "messages": [{"role": "user", "content": random.choice(PROMPTS)}]}
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        with self.client.post("/v1/chat/completions", json=body, stream=True,
                              catch_response=True, name="/v1/chat/completions (stream)") as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            for raw in r.iter_lines():
                line = raw.decode() if isinstance(raw, bytes) else raw
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if ttft is None and msg.get("choices") and msg["choices"][0]["delta"].get("content"):
                    ttft = (time.perf_counter() - t0) * 1000
                if msg.get("usage"):
                    tokens = msg["usage"]["completion_tokens"]
            r.success()
        if ttft is not None:
            self._report("TTFT", "chat stream", ttft)
        self._report("E2E", "chat stream", (time.perf_counter() - t0) * 1000)
        self._report("TOKENS", "chat stream", tokens)


class CompletionsUser(_Base):
    weight = 1

    @task
    def completion(self) -> None:
        body = {"model": self.model, "prompt": random.choice(PROMPTS),
                "max_tokens": MAX_TOKENS, "temperature": 0.8}
        with self.client.post("/v1/completions", json=body, catch_response=True,
                              name="/v1/completions") as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            tokens = r.json()["usage"]["completion_tokens"]
            r.success()
        self._report("TOKENS", "completions", tokens)
