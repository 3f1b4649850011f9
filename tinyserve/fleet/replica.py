"""One fleet replica: a Ray Serve deployment that runs the real tinyserve server as a child
process and relays requests to it.

The server keeps its own event loop, executor thread and signal handling; running it as a
child keeps all of that exactly as it is on a single machine, and lets Ray's replica actor
watch it from outside: when the child dies the replica's health check fails and Serve
replaces the replica. The child dies with the actor (PR_SET_PDEATHSIG), so a killed actor
leaves no orphan holding a GPU.

What the relay yields, in order: this replica's id (before anything can fail, so the
ingress knows whom to avoid on a retry), then ``(status, headers)``, then body chunks. A
streamed body is held back until its first event that carries output (the chat opening
event only names the role), so a failure before the first token is still retryable.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from tinyserve.fleet.relay import FleetRequest, ReplicaDown, relay_headers

log = logging.getLogger("ray.serve")

_LISTENING = re.compile(rb"listening on http://[^ ]+:(\d+) ")
_PR_SET_PDEATHSIG = 1
_MAX_LOG_LINE = 8192  # longer child log lines are cut (never stall the pipe)

try:  # resolved here: the child, between fork and exec, only calls it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: a killed actor may leave the child behind
    _prctl = None


def _death_signal(parent: int):
    """preexec_fn for the child: SIGKILL it when the replica's process dies."""
    def set_it() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
    return set_it


def has_output(event: bytes) -> bool:
    """Whether one SSE event (without its ``data: `` prefix) carries something the client
    must see from this replica and no other: a token, a finish, an error, the end."""
    if event == b"[DONE]":
        return True
    try:
        doc = msgspec.json.decode(event)
    except msgspec.DecodeError:
        return True  # not ours to judge: pass it on
    if not isinstance(doc, dict) or "error" in doc or doc.get("usage"):
        return True
    for choice in doc.get("choices") or ():
        if not isinstance(choice, dict):
            return True
        delta = choice.get("delta") or {}
        if (choice.get("finish_reason") is not None or choice.get("text")
                or delta.get("content") or delta.get("tool_calls") or choice.get("logprobs")):
            return True
    return False



def check_server_args(args: list[str]) -> None:
    """ValueError if server args set what each replica chooses itself: its host and port."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in ("--host", "--port"):
            raise ValueError(f"server args may not set {flag}: each replica runs its server on "
                             "127.0.0.1 on a free port")

class _Holdback:
    """Buffers a stream's bytes until an event with output is complete."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self._scanned = 0
        self.unavailable = False  # the first output is a 503-type error event

    def feed(self, chunk: bytes) -> bool:
        self.buf += chunk
        while (end := self.buf.find(b"\n\n", self._scanned)) >= 0:
            event, self._scanned = bytes(self.buf[self._scanned:end]), end + 2
            data = b"".join(line[5:].strip() for line in event.split(b"\n")
                            if line.startswith(b"data:"))
            if data and has_output(data):
                self.unavailable = b'"service_unavailable"' in data and b'"error"' in data
                return True
        return False


class ServerProcess:
    """The child ``python -m tinyserve`` and the address it listens on."""

    def __init__(self, server_args: list[str], env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> None:
        check_server_args(server_args)
        self.command = command or [sys.executable, "-m", "tinyserve", "--host", "127.0.0.1",
                                   "--port", "0"]
        self.server_args = server_args
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.port: int | None = None
        self._pump: asyncio.Task | None = None

    async def start(self, timeout_s: float) -> None:
        env = dict(os.environ, **(self.env or {}))
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        # Port 0: the server binds a free port and logs it; no race with other replicas.
        self.proc = await asyncio.create_subprocess_exec(
            *self.command, *self.server_args, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=env, preexec_fn=_death_signal(os.getpid()))
        found = asyncio.get_running_loop().create_future()
        self._pump = asyncio.create_task(self._forward_log(found))
        try:
            async with asyncio.timeout(timeout_s):
                self.port = await found
        except BaseException:
            await self.stop(0)
            raise

    async def _forward_log(self, found: asyncio.Future) -> None:
        """Relays the child's log into the replica's (Ray keeps it per actor). Reads chunks,
        not lines: a line of any length must not stop the draining of the pipe."""
        assert self.proc is not None and self.proc.stderr is not None
        pending = b""
        while chunk := await self.proc.stderr.read(65536):
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > _MAX_LOG_LINE:
                lines.append(pending)
                pending = b""
            for line in lines:
                if not found.done() and (m := _LISTENING.search(line[:_MAX_LOG_LINE])):
                    found.set_result(int(m.group(1)))
                log.info("server: %s", line[:_MAX_LOG_LINE].decode(errors="replace").rstrip())
        if pending:
            log.info("server: %s", pending[:_MAX_LOG_LINE].decode(errors="replace"))
        if not found.done():
            found.set_exception(RuntimeError(
                f"the server exited with {await self.proc.wait()} before listening"))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, grace_s: float) -> None:
        """SIGTERM (the server drains its requests), then SIGKILL after ``grace_s``."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._pump is not None:
            # EOF on stderr normally follows the exit; a grandchild holding the pipe must not
            # hold up the shutdown.
            try:
                await asyncio.wait_for(asyncio.shield(self._pump), 5)
            except Exception:
                self._pump.cancel()


class TinyserveReplica:
    """The Serve deployment class (decorated in :mod:`tinyserve.fleet.app`)."""

    async def __init__(self, server_args: list[str], startup_timeout_s: float = 600.0,
                       drain_timeout_s: float = 30.0) -> None:
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.drain_timeout_s = drain_timeout_s
        self.server = ServerProcess(server_args)
        self.session: aiohttp.ClientSession | None = None
        try:  # Serve counts a replica as started when __init__ returns: wait for the model.
            async with asyncio.timeout(startup_timeout_s):
                await self.server.start(startup_timeout_s)
                self.base = f"http://127.0.0.1:{self.server.port}"
                self.session = aiohttp.ClientSession(
                    auto_decompress=False,
                    timeout=aiohttp.ClientTimeout(total=None, connect=10),
                    connector=aiohttp.TCPConnector(limit=0))
                while not await self._ok("/ready"):
                    if not self.server.alive:
                        raise RuntimeError("the server exited while loading its model")
                    await asyncio.sleep(0.2)
        except BaseException:
            await self._close(0)
            raise
        self._open = True
        log.info("replica %s: server ready on %s", self.replica_id, self.base)

    async def _ok(self, path: str, timeout_s: float = 5.0) -> bool:
        assert self.session is not None
        try:
            async with self.session.get(self.base + path,
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def forward(self, req: FleetRequest) -> AsyncIterator[Any]:
        yield self.replica_id
        if not self.server.alive or self.session is None:
            raise ReplicaDown(self.replica_id, "its server process has exited")
        try:
            async with self.session.request(req.method, self.base + req.path_qs,
                                            headers=req.headers, data=req.body) as resp:
                yield resp.status, relay_headers(resp.headers.items())
                if not resp.content_type == "text/event-stream":
                    yield await resp.read()
                    return
                hold: _Holdback | None = _Holdback()
                tail = b""
                async for chunk in resp.content.iter_any():
                    if hold is not None:
                        if not hold.feed(chunk):
                            continue
                        if hold.unavailable:  # drained or down before any output: retryable
                            raise ReplicaDown(self.replica_id, "its server answered "
                                              "'service unavailable' before any output")
                        chunk, hold = bytes(hold.buf), None
                    # Whole events only: an error event after a failure must not be glued
                    # onto half of one.
                    data = tail + chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut >= 2:
                        yield data[:cut]
                    tail = data[cut:] if cut >= 2 else data
                rest = tail if hold is None else bytes(hold.buf)
                if rest:
                    yield rest
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ReplicaDown(self.replica_id, f"{type(e).__name__}: {e}") from None

    # -- read by Serve -------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Liveness: the child runs and answers /health. Serve replaces a replica that fails
        this (health_check_period_s / health_check_timeout_s)."""
        if not self.server.alive:
            raise RuntimeError(f"server process exited with {self.server.proc.returncode}")
        if not await self._ok("/health"):
            raise RuntimeError("server does not answer /health")

    async def record_routing_stats(self) -> dict[str, Any]:
        """Read by the router (tinyserve.fleet.router): readiness, queue and KV usage from
        the server's own /ready and /metrics."""
        if not self.server.alive or self.session is None:
            return {"ready": False}
        stats: dict[str, Any] = {"ready": await self._ok("/ready")}
        try:
            async with self.session.get(self.base + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = (await r.read()).decode()
        except (aiohttp.ClientError, TimeoutError):
            return stats
        stats.update(load_from_metrics(text))
        return stats

    async def _close(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
        if self.session is not None:
            await self.session.close()
            self.session = None

    def __del__(self):
        """Serve's shutdown hook, called once the replica's requests are done (or its
        graceful_shutdown_timeout_s is near): returns the coroutine Serve awaits, in which
        the server drains and exits. (Not ``async def``: the garbage collector calls
        ``__del__`` too, and must not be handed a coroutine nobody awaits.)"""
        if not getattr(self, "_open", False):
            return None
        self._open = False
        return self._close(self.drain_timeout_s)


def load_from_metrics(text: str) -> dict[str, float]:
    """Running, waiting and the highest KV usage over the server's models."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            # either namespace (--metrics-namespace vllm publishes the same series as vllm:)
            name = s.name.partition(":")[2] if s.name.startswith(("tinyserve:", "vllm:")) else ""
            if name == "num_requests_running":
                out["running"] += s.value
            elif name == "num_requests_waiting":
                out["waiting"] += s.value
            elif name == "kv_cache_usage_perc":
                out["kv_usage"] = max(out["kv_usage"], s.value)
    return out
