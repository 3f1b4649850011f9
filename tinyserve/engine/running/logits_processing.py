"""Everything between the logits and the sampled token beyond temperature/top-k/top-p:
penalties and logit_bias (the per-row token lists the penalties kernel reads), grammar masks
(structured output), and the prompt's own logprobs (prompt_logprobs, echo).

Penalty lists:

One row per sampled sequence; a row lists each distinct token it touches once:

    its output tokens (with counts)          presence / frequency / repetition penalties
    its prompt tokens (repetition only)      vLLM's repetition penalty counts the prompt too
    its logit_bias keys                       -100 bans (-inf), other biases add
    its banned ids (min_tokens)               -inf

Rows that process nothing list nothing (rep 1, no penalties): the kernel leaves them alone.
Cost per processed row and step: O(new tokens + distinct tokens + bias), with each
sequence's History kept across steps; paid only by requests that ask for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from tinyserve.kernels import apply_penalties, target_logprobs
from tinyserve.messages import FULL_VOCAB, PromptLogprobs, ScheduledSeq

if TYPE_CHECKING:
    from tinyserve.text.grammar import GrammarCompiler, Matcher

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, np.int64)


class PenaltyLists:
    """tokens [B, L] int32 (-1 pads), counts, in_prompt [B, L] int32, bias [B, L] fp32;
    rep, freq, pres [B] fp32."""

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                 rep: list[float], freq: list[float], pres: list[float]) -> None:
        B, L = len(rows), max((len(r[0]) for r in rows), default=0)
        self.tokens = np.full((B, L), -1, np.int32)
        self.counts = np.zeros((B, L), np.int32)
        self.in_prompt = np.zeros((B, L), np.int32)
        self.bias = np.zeros((B, L), np.float32)
        for i, (tok, cnt, inp, bias) in enumerate(rows):
            n = len(tok)
            self.tokens[i, :n], self.counts[i, :n] = tok, cnt
            self.in_prompt[i, :n], self.bias[i, :n] = inp, bias
        self.rep = np.asarray(rep, np.float32)
        self.freq = np.asarray(freq, np.float32)
        self.pres = np.asarray(pres, np.float32)


class History:
    """A sequence's penalty inputs kept across its steps, so a step costs O(new tokens +
    distinct tokens), not O(prompt + output): the prompt's distinct tokens (repetition
    penalty) once, the output's counts updated with each new token."""

    __slots__ = ("prompt", "counts", "n", "last")

    def __init__(self, prompt_ids: tuple[int, ...] | None) -> None:
        self.prompt = np.unique(np.asarray(prompt_ids, np.int64)) if prompt_ids else _EMPTY
        self.counts: dict[int, int] = {}
        self.n = 0  # output tokens counted
        self.last = -1  # the last of them

    def update(self, out: tuple[int, ...]) -> None:
        k = len(out) if not out or out[-1] >= 0 else len(out) - 1  # (an unfilled placeholder)
        if k < self.n or (self.n and out[self.n - 1] != self.last):  # a stale step was dropped
            self.counts.clear()
            self.n = 0
        counts = self.counts
        for t in out[self.n:k]:
            counts[t] = counts.get(t, 0) + 1
        self.n = k
        self.last = out[k - 1] if k else -1


def _row(s: ScheduledSeq, h: History) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    p = s.params
    h.update(s.output_ids or ())
    out_ids = np.fromiter(h.counts, np.int64, len(h.counts))
    out_counts = np.fromiter(h.counts.values(), np.int64, len(h.counts))
    bias_ids = np.fromiter((t for t, _ in p.logit_bias), np.int64, len(p.logit_bias))
    bias_vals = np.fromiter((b for _, b in p.logit_bias), np.float32, len(p.logit_bias))
    banned = np.asarray(s.banned, np.int64)
    ids = np.unique(np.concatenate([out_ids, h.prompt, bias_ids, banned]))
    counts = np.zeros(len(ids), np.int32)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    in_prompt = np.zeros(len(ids), np.int32)
    in_prompt[np.searchsorted(ids, h.prompt)] = 1
    bias = np.zeros(len(ids), np.float32)
    # OpenAI: -100 "should result in a ban"; vLLM adds it. A ban is exact here.
    bias[np.searchsorted(ids, bias_ids)] = np.where(bias_vals <= -100.0, -np.inf, bias_vals)
    bias[np.searchsorted(ids, banned)] = -np.inf
    return ids, counts, in_prompt, bias


def penalty_lists(seqs: Sequence[ScheduledSeq], histories: dict[int, History] | None = None
                  ) -> PenaltyLists | None:
    """The lists for one step's sampled sequences (None: no row lists anything).
    ``histories``: each sequence's History, kept by the caller across steps (none: built
    afresh, O(prompt + output))."""
    if not any(s.params.penalized for s in seqs):
        return None
    none = (_EMPTY, _EMPTY, _EMPTY, np.zeros(0, np.float32))
    rows = []
    for s in seqs:
        if not s.params.penalized:
            rows.append(none)
            continue
        h = histories.get(s.seq_id) if histories is not None else None
        if h is None:
            h = History(s.prompt_ids)
            if histories is not None:
                histories[s.seq_id] = h
        rows.append(_row(s, h))
    if not any(len(r[0]) for r in rows):  # e.g. a presence penalty before any output
        return None
    return PenaltyLists(rows, [s.params.repetition_penalty for s in seqs],
                        [s.params.frequency_penalty for s in seqs],
                        [s.params.presence_penalty for s in seqs])


class LogitsProcessors:
    """The runner's logits processing; its state (grammar matchers) is the worker thread's."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int],
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.grammars: GrammarCompiler | None = None  # structured output, set by the DeviceEngine
        # seq id -> its grammar matcher and the output tokens it has accepted
        self._matchers: dict[int, tuple[Matcher | None, list[int]]] = {}
        self._histories: dict[int, History] = {}  # penalized sequences' counts

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Released sequences (a preempted one replays its output into a new matcher)."""
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)
            self._histories.pop(seq_id, None)

    def grammar_masks(self, seqs: list[ScheduledSeq]
                      ) -> tuple[np.ndarray | None, dict[int, tuple[str, str]]]:
        """([n, ceil(V / 32)] int32 allowed-token bits, all ones for unconstrained rows, or
        None when no row has a grammar; the rows whose grammar failed or is at a dead end,
        row -> (reason, message)). Those rows allow nothing: ``dead_ends`` ends them with an
        error, never with a token. (Returned, not kept: the next step's masks may be filled
        before this step's dead ends are read.)"""
        failed: dict[int, tuple[str, str]] = {}
        if not any(s.params.guided is not None for s in seqs):
            return None, failed
        words = np.full((len(seqs), -(-self.vocab_size // 32)), -1, np.int32)
        for i, s in enumerate(seqs):
            if s.params.guided is not None:
                why = self._fill(s, words[i])
                if why is not None:
                    words[i] = 0
                    failed[i] = (why[0], f"structured output: {why[1]}; the output "
                                 "so far does not satisfy it, so the request ends here")
        return words, failed

    def _fill(self, s: ScheduledSeq, row: np.ndarray) -> tuple[str, str] | None:
        """Fill the row's mask; None, or why the grammar allows nothing: (reason, message).
        Reasons: ``grammar``, the request's grammar failed (it does not compile here, or its
        matcher stopped: a dead end it reports as an error, or a limit); ``dead_end``, it
        allows no token; ``grammar_crash``, the matcher itself raised (the server's fault).
        """
        try:
            m = self._matcher(s)
            if m is None:
                return "grammar", "the grammar does not compile"
            if m.fill(row):
                return None
            err = m.error
            if err is not None:
                if "too many states" in err and self.grammars is not None:
                    # its cached lexer is full: later requests compile it afresh (running
                    # ones keep theirs), so one client's outputs cannot break it for others
                    self.grammars.forget(s.params.guided)
                return "grammar", (f"the grammar matcher stopped after {m.num_accepted} "
                                   f"tokens (a dead end or a matcher limit): {err}")
            return "dead_end", (f"the grammar allows no token after {m.num_accepted} tokens "
                                "(a dead end)")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # llguidance's PanicException is a BaseException
            log.exception("seq %d: grammar matcher failed", s.seq_id)
            return "grammar_crash", f"the grammar matcher failed: {str(e)[:200]}"

    def dead_ends(self, seqs: list[ScheduledSeq], masks: np.ndarray | None,
                  failed: dict[int, tuple[str, str]]) -> dict[int, int | tuple[str, str]]:
        """Rows where the grammar, logit_bias bans and min_tokens bans leave no token (the
        sampler would draw a banned one): row -> the EOS id to end with, where the request
        allows EOS (only min_tokens bans it), else (reason, message) to end with an error.
        O(V / 32) per row that bans tokens or has a grammar; nothing for the others."""
        out: dict[int, int | tuple[str, str]] = dict(failed)
        V = self.vocab_size
        for i, s in enumerate(seqs):
            p = s.params
            hard = [t for t, b in p.logit_bias if b <= -100.0]
            if i in out or not (hard or s.banned):
                continue
            guided = masks is not None and p.guided is not None
            if guided:
                bits = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:V].astype(bool)
            else:
                if len(set(hard) | set(s.banned)) < V:
                    continue
                bits = np.ones(V, bool)
            allowed_eos = [t for t in self.eos_token_ids if t < V and bits[t]]
            bits[hard] = False
            bits[list(s.banned)] = False
            if bits.any():
                continue
            eos = [t for t in allowed_eos if t not in hard]
            out[i] = eos[0] if eos else ("nothing_allowed", "logit_bias: its -100 bans, "
                                         "min_tokens and the grammar leave no token to "
                                         f"draw after {len(s.output_ids or ())} tokens")
        return out

    def _matcher(self, s: ScheduledSeq) -> Matcher | None:
        """The sequence's matcher, caught up with its output (``output_ids``, the pending
        token filled in): usually nothing to do; after a dropped stale step, a rollback."""
        entry = self._matchers.get(s.seq_id)
        if entry is None:
            try:
                entry = (self.grammars.matcher(s.params.guided), [])
            except Exception:  # refused at the API; offline, it ends with an error
                log.warning("seq %d: its grammar does not compile", s.seq_id)
                entry = (None, [])
            self._matchers[s.seq_id] = entry
        m, accepted = entry
        if m is None:
            return None
        history = s.output_ids or ()
        common = min(len(accepted), len(history))
        while common and accepted[common - 1] != history[common - 1]:
            common -= 1
        if len(accepted) > common:
            m.rollback(len(accepted) - common)
            del accepted[common:]
        for t in history[common:]:
            if t < 0 or not m.accept(t):
                break
            accepted.append(t)
        return m

    def advance(self, seqs: list[ScheduledSeq], tokens: list[int]) -> None:
        for s, t in zip(seqs, tokens, strict=True):
            entry = self._matchers.get(s.seq_id) if s.params.guided is not None else None
            if entry is not None and entry[0] is not None:
                if _guarded(entry[0].accept, t):
                    entry[1].append(t)

    def processed(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor | None:
        """logits [n, V] after penalties and logit_bias (None: no row asks for them). In place
        unless someone wants logprobs, which vLLM reports from the raw logits."""
        lists = penalty_lists(seqs, self._histories)
        if lists is None:
            return None
        processed = logits
        if any(s.params.logprobs is not None for s in seqs):
            processed = torch.empty_like(logits)
            processed.copy_(logits)
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev)

        apply_penalties(processed, put(lists.tokens), put(lists.counts), put(lists.in_prompt),
                        put(lists.bias), put(lists.rep), put(lists.freq), put(lists.pres))
        return processed

    def prompt_logprobs(self, logits: torch.Tensor, seqs: list[ScheduledSeq]
                        ) -> tuple[PromptLogprobs, ...]:
        """logits [R, V]: the rows of every chunk's prompt_targets, in plan order."""
        wanted = [s for s in seqs if s.prompt_targets]
        targets = torch.tensor([t for s in wanted for t in s.prompt_targets], dtype=torch.int64,
                               device=self.device)
        num_top = max(max(s.params.prompt_logprobs or 0, 0) for s in wanted)
        lps, ranks, top_ids, top_lps = target_logprobs(logits, targets, num_top)
        lps_l, ranks_l = lps.tolist(), ranks.tolist()
        tops = list(zip(top_ids.tolist(), top_lps.tolist(), strict=True)) if num_top else None
        out, i = [], 0
        for s in wanted:
            n, k = len(s.prompt_targets), s.params.prompt_logprobs or 0
            rows = range(i, i + n)
            if k == FULL_VOCAB:
                top_of = _whole_vocabulary(logits[i:i + n], s.prompt_targets, lps_l[i:i + n])
            elif tops and k:
                top_of = [tuple(zip(tops[j][0][:k], tops[j][1][:k], strict=True)) for j in rows]
            else:
                top_of = [()] * n
            out.append(PromptLogprobs(s.seq_id, s.start_pos, tuple(
                (lps_l[j], ranks_l[j], top) for j, top in zip(rows, top_of, strict=True))))
            i += n
        return tuple(out)


def _whole_vocabulary(logits: torch.Tensor, targets: Sequence[int], lps: list[float]
                      ) -> list[tuple[tuple[int, float], ...]]:
    """logits [n, V], lps: each target's logprob (from the kernel) -> per row every
    token's (id, logprob), most likely first (ties: lower id first), as the top-N kernel
    orders them. On the host: prompt_logprobs=-1 is bounded (MAX_PROMPT_LOGPROB_ENTRIES) and
    N rounds of the top-N kernel's argmax would cost O(V^2) a row. Each logprob is x - lse
    in float32 with lse = x[target] - lp[target], the kernel's own arithmetic, and the
    target's entry is its logprob bit for bit."""
    x = logits.cpu().numpy()  # [n, V] float32
    lp_t = np.asarray(lps, dtype=np.float32)  # [n] (float32 values: exact)
    rows = np.arange(len(targets))
    t = np.asarray(targets, dtype=np.int64)
    lse = x[rows, t] - lp_t  # [n]
    lp = x - lse[:, None]
    lp[rows, t] = lp_t
    order = np.argsort(-x, axis=1, kind="stable")  # [n, V]
    ids, ordered = order.tolist(), np.take_along_axis(lp, order, axis=1).tolist()
    return [tuple(zip(a, b, strict=True)) for a, b in zip(ids, ordered, strict=True)]


def _guarded(fn, *args) -> bool:
    """A grammar call that fails counts as False (the next mask reports the sequence's
    failure): never the step's failure. llguidance reports a Rust panic as pyo3's PanicException, a
    BaseException, which would otherwise end the executor's worker thread."""
    try:
        return bool(fn(*args))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        log.exception("grammar matcher failed: that sequence can only end")
        return False
