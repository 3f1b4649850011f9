"""Teacher-forced quality of a quantized engine against a reference one (usually fp32).

Both read the same token sequence in one prefill; at every position we take the model's top
next token and its log-probability of the token that really comes next:

    agreement      share of positions whose top token is the reference model's top token
    mean |dlogp|   mean over positions of |logp(x[i] | x[:i]) - logp_ref(x[i] | x[:i])|

Teacher forcing (not free-running generation) keeps one early disagreement from changing
everything after it, so the numbers measure the numerics, position by position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tinyserve.messages import SamplingParams


@dataclass(frozen=True, slots=True)
class Scored:
    """Per position i >= 1 of a token sequence: the top next token, logp of ids[i], and the
    top token's own logp (how sure the model is)."""

    top: tuple[int, ...]
    logprob: tuple[float, ...]
    top_logprob: tuple[float, ...] = ()


def score(llm, token_ids: Sequence[int]) -> Scored:
    """One prefill of ``token_ids`` through an ``LLM`` with prompt logprobs (top 1)."""
    out = llm.generate([list(token_ids)], SamplingParams(max_tokens=1, temperature=0.0,
                                                         prompt_logprobs=1))[0]
    top, lp, top_lp = [], [], []
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        # the entry holds ids[i] and the top token: one key when they are the same
        top.append(max(entry, key=entry.__getitem__))
        lp.append(entry[token_ids[i]])
        top_lp.append(entry[top[-1]])
    return Scored(tuple(top), tuple(lp), tuple(top_lp))


def mean_top_probability(scored: Sequence[Scored]) -> float:
    """The mean probability of the top token: near 1 a confident model, whose top token a
    small error rarely flips; near 1 / vocabulary an unsure one."""
    import math

    probs = [math.exp(x) for s in scored for x in s.top_logprob]
    return sum(probs) / len(probs)


@dataclass(frozen=True, slots=True)
class Agreement:
    positions: int
    agreement: float
    mean_abs_dlogprob: float


def compare(ref: Sequence[Scored], other: Sequence[Scored]) -> Agreement:
    """Pooled over several sequences scored by both engines."""
    same = total = 0
    dl = 0.0
    for a, b in zip(ref, other, strict=True):
        same += sum(x == y for x, y in zip(a.top, b.top, strict=True))
        dl += sum(abs(x - y) for x, y in zip(a.logprob, b.logprob, strict=True))
        total += len(a.top)
    return Agreement(total, same / total, dl / total)
