"""What crosses from the fleet's ingress to a replica: the request to relay (with the text the
router matches against each replica's prefixes), its end-to-end headers, and the error a
replica that cannot answer raises."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from tinyserve.cli.tenants import load_tenants
from tinyserve.config import ServerConfig, TenantConfig

# Per-connection headers (RFC 9110 7.6.1) and ones the relaying HTTP stacks set themselves.
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                  "trailer", "transfer-encoding", "upgrade", "host", "content-length", "date",
                  "server"})


def relay_headers(items: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """End-to-end headers only, names lower-cased (HTTP names are case-insensitive)."""
    return [(k.lower(), v) for k, v in items if k.lower() not in _HOP]


@dataclass
class FleetRequest:
    """One HTTP request on its way to a replica. ``prompt`` is the text the router matches
    against the prefixes each replica has seen; ``exclude`` names replicas a retry avoids."""

    method: str
    path_qs: str
    headers: list[tuple[str, str]]
    body: bytes
    prompt: str = ""
    exclude: tuple[str, ...] = field(default=())


def server_tenants(server_args: list[str]) -> tuple[TenantConfig, ...]:
    """The tenants (and keys) a replica's server accepts with these args (its --tenants
    file or --api-key, read where this runs: the ingress reads them as the replicas do)."""
    from tinyserve.cli.flags import build_parser

    args = build_parser().parse_args(server_args)
    tenants = load_tenants(args.tenants) if args.tenants else ()
    return ServerConfig(api_key=args.api_key, tenants=tenants).tenant_list


def header_text(value: str) -> str:
    """A header value as the replica's aiohttp reads it: Starlette decodes header bytes as
    latin-1, aiohttp as UTF-8 (undecodable bytes kept as surrogates)."""
    return value.encode("latin-1", "replace").decode("utf-8", "surrogateescape")


class ReplicaDown(Exception):
    """The replica could not answer: its server is gone or the connection to it broke."""

    def __init__(self, replica_id: str, why: str) -> None:
        super().__init__(f"replica {replica_id}: {why}")
        self.replica_id, self.why = replica_id, why

    def __reduce__(self):  # raised in the replica, re-raised in the ingress
        return ReplicaDown, (self.replica_id, self.why)


def routing_text(body: bytes) -> str:
    """The prompt text of a completion or chat request, after its ``model`` and a NUL (what
    the prefix tree keys on: a LoRA adapter's KV blocks are its own, so the same prompt on two
    adapters is two prefixes; policy.prefix_counts skips the key); "" for anything else. The
    key is always there ("" without a model) and holds no NUL, so the first NUL ends it. Never
    raises: the replica judges the body."""
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return ""
    if not isinstance(doc, dict):
        return ""
    text = _prompt_text(doc)
    model = doc.get("model")
    key = model.replace("\0", " ") if isinstance(model, str) else ""
    return f"{key}\0{text}" if text else ""


def _prompt_text(doc: dict) -> str:
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:  # a batch routes on its first prompt
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):  # token ids: their text form shares prefixes just as well
            return " ".join(str(t) for t in prompt if isinstance(t, int))
        if isinstance(first, list):
            return " ".join(str(t) for t in first if isinstance(t, int))
        return ""
    messages = doc.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, str):
                parts.append(f"{m.get('role', '')}:{content}\n")
            elif isinstance(content, list):
                parts.append(f"{m.get('role', '')}:" + "".join(
                    p.get("text", "") for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)) + "\n")
        return "".join(parts)
    return ""
