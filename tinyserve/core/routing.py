"""Model routing: which served model answers a request's ``model``.

A request names a served model, or an alias set up with ``--route ALIAS=NAME:WEIGHT,...``
(a gray release). An alias splits its traffic by weight, sticky per key (the request's
``user``, else its tenant): the key hashes to a point in [0, 1), and the targets own
consecutive slices of that interval in the order they were given. One key therefore always
lands on one model while the weights stand, and a weight change moves only the keys whose
point changes slices (90/10 -> 80/20 moves a tenth of the users, all from the first to the
second).

The route table's only writer is the API's admin route (``POST /admin/routes``); a change is
one dict assignment on the event loop, so a request is routed by the old table or the new one,
never half of each, and requests already routed keep their model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

Weights = tuple[tuple[str, float], ...]
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e9  # (sums stay finite and exact enough to split by)


def sticky_point(alias: str, key: str) -> float:
    """Where a key lands on [0, 1) for one alias (independent across aliases)."""
    digest = hashlib.blake2b(f"{alias}\0{key}".encode("utf-8", "surrogatepass"),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2**53  # 53 bits: exact, never 1.0


def check_weights(alias: str, weights: Weights, models: Iterable[str]) -> Weights:
    """The weights, if they are a valid split over served models (else ValueError)."""
    known = set(models)
    if not weights:
        raise ValueError(f"route {alias}: no targets")
    names = [n for n, _ in weights]
    if len(set(names)) != len(names):
        raise ValueError(f"route {alias}: a model is listed twice")
    for name, w in weights:
        if name not in known:
            raise ValueError(f"route {alias}: {name!r} is not a served model "
                             f"(served: {', '.join(sorted(known))})")
        if not (isinstance(w, (int, float)) and not isinstance(w, bool)
                and (w == 0 or MIN_WEIGHT <= w <= MAX_WEIGHT)):
            raise ValueError(f"route {alias}: the weight of {name} must be 0 or a number in "
                             f"[{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]")
    if not sum(w for _, w in weights) > 0:
        raise ValueError(f"route {alias}: the weights must not all be 0")
    return tuple((n, float(w)) for n, w in weights)


class Router:
    def __init__(self, models: Iterable[str], routes: Iterable[tuple[str, Weights]] = (),
                 fallbacks: Iterable[tuple[str, str]] = (), adapters: Iterable[str] = ()
                 ) -> None:
        self.models = tuple(models)
        # LoRA adapters' names: routes may target them (the server keeps it current as
        # adapters load and unload); a request for one is resolved to its base by the API
        self.adapters: set[str] = set(adapters)
        self.routes: dict[str, Weights] = {}
        for alias, weights in routes:
            if alias in self.models or alias in self.routes or alias in self.adapters:
                raise ValueError(f"route {alias}: the name is already a model, an adapter or "
                                 "a route")
            self.routes[alias] = check_weights(alias, weights, self.targets)
        self.fallbacks: dict[str, str] = {}
        for name, other in fallbacks:
            if name not in self.models or other not in self.models:
                raise ValueError(f"fallback {name}={other}: both must be served models "
                                 f"(served: {', '.join(self.models)})")
            if name == other or name in self.fallbacks:
                raise ValueError(f"fallback {name}={other}: one other model per model")
            self.fallbacks[name] = other

    def resolve(self, name: str, key: str, down: frozenset[str] | set[str] = frozenset()
                ) -> str | None:
        """The served model for a request's ``model``; None if it names nothing served.
        A key whose target is ``down`` is spread over the targets still up (by a second,
        equally sticky point) while any is; every other key stays where it was."""
        if name in self.models or name in self.adapters:
            return name
        weights = self.routes.get(name)
        if weights is None:
            return None
        target = _pick(weights, sticky_point(name, key))
        if target in down:
            up = tuple((t, w) for t, w in weights if t not in down and w > 0)
            if up:
                target = _pick(up, sticky_point(name + "\0down", key))
        return target

    def set_route(self, alias: str, weights: Weights) -> Weights:
        """Replace an alias's weights (live); returns the old ones. The targets keep their
        order (new ones go last), so their slices move as little as the weights allow,
        whatever order the new weights are listed in."""
        if alias not in self.routes:
            raise KeyError(alias)
        old = self.routes[alias]
        new = check_weights(alias, weights, self.targets)
        rank = {name: i for i, (name, _) in enumerate(old)}
        self.routes[alias] = tuple(sorted(new, key=lambda t: rank.get(t[0], len(rank))))
        return old

    @property
    def targets(self) -> tuple[str, ...]:
        """What a route may name: the served models and the adapters."""
        return self.models + tuple(sorted(self.adapters))

    def table(self) -> dict[str, dict[str, float]]:
        return {alias: dict(w) for alias, w in self.routes.items()}


def _pick(weights: Weights, point: float) -> str:
    """The target whose slice of [0, 1) holds ``point`` (slices in order, by weight)."""
    point *= sum(w for _, w in weights)
    for target, w in weights:
        if point < w:
            return target
        point -= w
    return next(t for t, w in reversed(weights) if w > 0)  # rounding at the very top


def describe(weights: Weights) -> str:
    return ",".join(f"{n}:{w:g}" for n, w in weights)
