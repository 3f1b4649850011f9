"""What a request asks for: SamplingParams (each field checked where it is built, FieldError
naming the field), GrammarSpec, and the limits on both. Values inside messages.py's messages;
re-exported there, so the wiring diagram stays one import."""

from __future__ import annotations

import math

import msgspec

# -- what a request asks for ----------------------------------------------------------------


class FieldError(ValueError):
    """A request value that cannot be taken; ``field`` names it (the 400's ``param``). Raised
    by SamplingParams' range checks and the engine core's vocabulary checks."""

    def __init__(self, field: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.field, self.code = field, code


MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
FULL_VOCAB = -1  # prompt_logprobs: every token of the vocabulary at each position (vLLM's -1)
# prompt_logprobs=-1: at most this many (position, token) entries per API request, (prompt
# tokens - 1) x vocabulary x choices. Each is a host tuple here and ~85 bytes of JSON in the
# answer (measured): 2^18 is ~22 MB, the whole context of a 512-token vocabulary (stories260k),
# a 9-token prompt with a 32k one.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string: bounds the detokenizer's hold-back per step
MAX_LOGIT_BIAS = 1024  # logit_bias entries: bounds the per-step penalty lists


class GrammarSpec(msgspec.Struct, frozen=True):
    """Structured output (grammar.py): ``kind`` is json_object, json_schema (``value``: the
    schema as JSON text), regex (the pattern), choice (a JSON list of strings) or grammar
    (Lark or GBNF text). ``scope`` is the tenant's cache group: compiled grammars are cached
    per scope, so tenants never evict each other's."""

    kind: str
    value: str = ""
    scope: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives per generated token (0: only the chosen one)
    skip_special_tokens: bool = True
    # vLLM's penalties (OpenAI's presence/frequency count output tokens only; repetition
    # counts prompt and output) and logit_bias ((token, bias) pairs; -100 bans the token).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are out
    # top-N per prompt token (0: only the prompt's own; FULL_VOCAB: all of them, bounded by
    # MAX_PROMPT_LOGPROB_ENTRIES in core.engine_core.check_sampling_vocabulary)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    guided: GrammarSpec | None = None  # the output must match this grammar
    return_token_ids: bool = False  # vLLM's: each Output carries its new token ids

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        else:
            stop = tuple(stop)
        msgspec.structs.force_setattr(self, "stop", stop)
        msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        if any(math.isnan(b) for _, b in bias):  # (NaN would pass the clamp below)
            raise FieldError("logit_bias", "logit_bias values must be numbers, got NaN")
        # vLLM clamps biases to [-100, 100]; the last entry for a token wins (as in a dict)
        merged = {int(t): min(100.0, max(-100.0, float(b))) for t, b in bias}
        msgspec.structs.force_setattr(self, "logit_bias", tuple(sorted(merged.items())))
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise FieldError("max_tokens", "max_tokens must be an integer >= 1, got "
                             f"{self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise FieldError("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise FieldError("top_k", "top_k must be -1, 0 (disabled) or a positive integer, got "
                      f"{self.top_k}")
        if self.seed is not None and not (isinstance(self.seed, int)
                                          and -(2**63) <= self.seed < 2**64):
            raise FieldError("seed", f"seed must be a 64-bit integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got "
                      f"{len(self.stop)}")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop):
            raise FieldError("stop", f"stop must be a string or a list of strings of 1 to "
                      f"{MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS or not all(
                isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise FieldError("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_STRINGS} "
                      "non-negative integers")
        v = self.logprobs
        if v is not None and not (isinstance(v, int) and 0 <= v <= MAX_LOGPROBS):
            raise FieldError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {v}")
        v = self.prompt_logprobs
        if v is not None and not (isinstance(v, int) and (0 <= v <= MAX_LOGPROBS
                                                          or v == FULL_VOCAB)):
            raise FieldError("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"
                             f" or {FULL_VOCAB} (the whole vocabulary), got {v}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise FieldError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise FieldError("repetition_penalty", "repetition_penalty must be in (0, 2], got "
                      f"{self.repetition_penalty}")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise FieldError("min_tokens", f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                      f"got {self.min_tokens!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(t < 0 for t, _ in self.logit_bias):
            raise FieldError("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} non-negative "
                      "token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """The logits need processing before sampling (penalties.py): per-step host work."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    @property
    def needs_history(self) -> bool:
        """Each draw's ScheduledSeq carries the output so far (penalties, a grammar)."""
        return self.penalized or self.guided is not None
