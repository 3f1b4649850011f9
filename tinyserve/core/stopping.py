"""When a sequence stops, and why: every rule in one place. The scheduler, the engine core and
the replies carry the decisions out; they decide nothing themselves.

    a token     a stop token: EOS (unless ignore_eos) or a stop_token_ids entry    "stop"
                the length limit: max_tokens, or max_model_len                     "length"
    the text    a stop string the detokenizer matched: the text is cut there, and  "stop"
                a verify's tokens after the one that completed it are dropped
    reported    vLLM's stop_reason: the stop string, or the stop_token_ids entry
                that ended it; None for EOS (and for any other finish)

A stop token still counts as a completion token; its text stays out of the output unless it
is a stop_token_ids entry and include_stop_str_in_output asks for it (EOS never shows).
"""

from __future__ import annotations

from collections.abc import Callable

from tinyserve.core.sequence import Sequence
from tinyserve.messages import SamplingParams
from tinyserve.text.detokenizer import IncrementalDetokenizer

Finish = Callable[[Sequence, str], None]  # the scheduler's: end it (blocks freed), with a reason


def limits(params: SamplingParams, prompt_len: int, eos_ids: frozenset[int],
           max_model_len: int) -> tuple[frozenset[int], int]:
    """(the tokens that end it, the length at which it ends): worked out once, when the
    sequence is added, since they are read for every token of every step."""
    stop_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else eos_ids)
    return stop_ids, min(prompt_len + params.max_tokens, max_model_len)


def after_token(seq: Sequence, token: int) -> str | None:
    """The finish reason once ``token`` is appended, or None: it goes on."""
    if token in seq.stop_ids:
        return "stop"
    if len(seq.token_ids) >= seq.token_limit:  # max_tokens out, or max_model_len
        return "length"
    return None


def after_text(seq: Sequence, detok: IncrementalDetokenizer, eos_ids: frozenset[int],
               finish: Finish) -> None:
    """The step's new tokens (one, or a verify's several) into the text, finishing on a stop
    string: a verify's tokens after the one that completed it are dropped, as plain decoding
    would never have drawn them."""
    if seq.num_new == 1 and seq.finish_reason is None:  # a decode's token: the common case
        detok.add(seq.token_ids[-1])
        if detok.stopped:
            finish(seq, "stop")
        return
    new = seq.token_ids[len(seq.token_ids) - seq.num_new:]
    for i, token in enumerate(new):
        if i == len(new) - 1 and seq.finish_reason == "stop" and _silent(seq, eos_ids):
            return
        detok.add(token)
        if detok.stopped:
            extra = len(new) - 1 - i
            if extra:  # (they would never have been drawn: whatever ended the
                del seq.token_ids[-extra:]  # sequence at the last of them did not)
                if seq.params.logprobs is not None:
                    del seq.logprobs[-extra:]
                seq.num_new -= extra
                seq.finish_reason = seq.finish_reason and "stop"
            if not seq.is_finished:
                finish(seq, "stop")
            return


def _silent(seq: Sequence, eos_ids: frozenset[int]) -> bool:
    """The last token is a stop token whose text stays out of the output."""
    last, p = seq.token_ids[-1], seq.params
    if not p.ignore_eos and last in eos_ids:
        return True
    return last in p.stop_token_ids and not p.include_stop_str_in_output


def stop_reason(seq: Sequence, detok: IncrementalDetokenizer) -> str | int | None:
    """What ended a sequence that finished with "stop": its stop string, or its stop token
    (EOS: None, as vLLM reports it)."""
    if seq.finish_reason != "stop":
        return None
    if detok.matched is not None:
        return detok.matched
    last = seq.token_ids[-1]
    return last if last in seq.params.stop_token_ids else None
