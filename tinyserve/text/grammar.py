"""Structured output: next-token bitmasks that keep a completion inside a grammar.

A request asks for a :class:`GrammarSpec`: any JSON object, a JSON Schema, a regex (Rust
``regex`` syntax: no look-around or back-references), one of a list of strings, or a grammar in
llguidance's Lark dialect (or llama.cpp GBNF, converted to it). :class:`GrammarCompiler` turns
a spec into a :class:`CompiledGrammar`, cached; each sequence gets a :class:`Matcher`, which
fills the bitmask the sampler applies to the logits and advances on the sampled token.

The backend is llguidance (Rust: an Earley parser over a lazily built regex-derivative lexer,
the token trie walked per mask), chosen over xgrammar by ``loadtest/bench_grammar.py``. It
compiles 3-30x faster (1-3 ms; xgrammar precomputes token masks per grammar: 17-50 ms at a
128K vocabulary on two cores), which matters because compile runs on the event loop and
requests often bring schemas of their own; it has no dependencies (xgrammar needs transformers
and apache-tvm-ffi besides torch and triton, and takes ~2 s to import). Per token xgrammar is
faster: 2-4 µs against llguidance's 4-9 µs for JSON, both small next to a decode step.

Masks are exact: a token is allowed iff its bytes keep the output a prefix of some string of
the language, and the EOS ids iff the output is complete. llguidance by default "forces" bytes
that the grammar fixes, allowing only their canonical tokenization; that relies on the
tokenizer encoding byte slices canonically and narrows the model's choice, so it is off
(``no_forcing``; measured a little faster too). A grammar stuck on an incomplete output (a rule
that never ends) is a dead end: ``fill`` allows nothing, where llguidance would allow EOS.

Costs and limits (measured on two CPU cores):

- ``GrammarCompiler()`` builds llguidance's token trie once, O(vocab): 15 ms at 512 tokens,
  0.13 s at 32K, 0.7 s at 128K.
- ``compile()`` takes 1-3 ms for a typical schema, regex or choice list (the GIL is released,
  the caller waits); llguidance warns that extremely complex grammars take 0.1-1 s, so a server
  may run cache misses in a thread. The lexer is built lazily, shared by a grammar's matchers:
  a new grammar's first masks cost 10-30 µs each.
- ``fill`` + ``accept``: median 5-9 µs per token, p95 under 30 µs, for JSON at up to 128K
  tokens (JSON strings are fast thanks to llguidance's precomputed "slices"). A regex or
  grammar that lets most of the vocabulary through by other means (``( [a-z]+)*`` over a
  vocabulary of words) walks the whole token trie: ~20 µs median, ~2 ms p95 at 128K.
- ``rollback`` goes back any number of tokens, up to all accepted (llguidance keeps the
  parser's whole history). JSON is laid out as ``json.dumps`` does (no free
  whitespace: see _JSON_LAYOUT).
- A mask step past llguidance's lexer/parser fuel limits is an error (``Matcher.error``):
  the runner ends the request with it, never with a normal finish.

Threads: ``compile`` may run on the event loop while matchers run on a worker thread; the
cache is behind a lock, and a CompiledGrammar's matcher is never advanced once published, only
copied. A Matcher is used by one thread at a time.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from tinyserve.messages import GrammarSpec

if TYPE_CHECKING:
    from tinyserve.text.tokenizer import Tokenizer

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# Appended rather than prepended: the line numbers in a grammar's errors stay the client's.
# JSON laid out as json.dumps does, with no free whitespace: a weak model sampled at a high
# temperature can otherwise spend its whole budget on spaces and newlines between tokens
# (a schema's own "x-guidance" options win).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_OPTIONS = '\n%llguidance {"no_forcing": true}\n'
# No parser-state dumps in errors; the lexer's lazily built automaton, which lives in the
# cached grammar and grows with what outputs explore, bounded at MAX_LEXER_STATES (measured at
# ~600 B a state: ~30 MB; llguidance's default, 250,000, let a 16-byte regex grow to 150 MB).
# Past it the request ends with a 400 and the grammar leaves the cache (see forget).
MAX_LEXER_STATES = 50_000
_LIMITS = llguidance.LLParserLimits(verbose_errors=False, max_lexer_states=MAX_LEXER_STATES)
_LISTING = re.compile(r"\n\s*\d+ \| ")  # llguidance quotes the Lark source after the message
_POSITION = re.compile(r"^at \d+\(\d+\): ")
# guided_choice values. As one lexeme the real limit is llguidance's initial lexer fuel
# (1,000,000): 100,000 short values ("c0".."c99999") compile in 0.45 s and run, 300,000 fail
# to compile after 1.7 s and 200 MB; refused before any of that.
MAX_CHOICES = 100_000
# A compiled grammar's memory, estimated from its Lark text (llguidance reports none): the
# lexer built as masks are computed dominates, measured at ~26 bytes of RSS per byte of a
# 30,000-value choice list's text (1.2 MB of text: +31 MB); plus a floor for the matcher.
BYTES_PER_LARK_BYTE = 32
GRAMMAR_FLOOR_BYTES = 64 * 1024
COMPILE_SLOTS = 4  # compiles at once (each at most max_grammar_bytes): the rest wait


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _lark(spec: GrammarSpec) -> str:
    kind, value = spec.kind, spec.value
    if kind == "json_object":
        return "start: %json " + json.dumps({"type": "object", "x-guidance": _JSON_LAYOUT})
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except ValueError as e:
            raise ValueError(f"json_schema: not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("json_schema: the schema must be a JSON object")
        schema.setdefault("x-guidance", _JSON_LAYOUT)
        return "start: %json " + json.dumps(schema)  # re-encoded: nothing can trail it
    if kind == "regex":
        return f"start: /{llguidance.regex_to_lark(value)}/"
    if kind == "choice":
        try:
            choices = json.loads(value)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice: the value must be a JSON list of strings")
        if not choices:
            raise ValueError("choice: the list is empty, so no output can match it")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"choice: {len(choices)} values, more than the limit of "
                             f"{MAX_CHOICES}")
        values = [c for c in dict.fromkeys(choices) if c]
        if not values:  # only the empty output
            return 'start: ""'
        # One lexeme, not a parser rule with an alternative per value: the Earley parser
        # holds one item per live alternative in a row and fails mid-output past 2,000
        # (max_items_in_row), while the lexer handles the list as one regex: 30,000 values
        # compile in 0.12 s, not 1.3 s, and run (measured, see MAX_CHOICES). A lexeme cannot
        # be empty: "" in the list makes it optional.
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in values)
        return f"start: CHOICE{'?' if '' in choices else ''}\nCHOICE: " + alts
    if kind == "grammar":
        try:
            return any_to_lark(value)
        except Exception as e:  # the GBNF converter raises its own error types
            raise ValueError(f"grammar: {e}") from None
    raise ValueError(f"kind: must be one of {', '.join(KINDS)}, not {kind!r}")


def _client_message(kind: str, error: str) -> str:
    error = _LISTING.split(error, maxsplit=1)[0]
    if kind != "grammar":  # a position in the Lark text built here means nothing to a client
        error = _POSITION.sub("", error)
    return f"{kind}: {error.strip()}"


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A compiled spec: a fresh llguidance matcher that new matchers are copied from."""

    spec: GrammarSpec
    _pristine: llguidance.LLMatcher
    _done_at_start: bool
    _vocab_size: int
    _lib_words: int
    _eos: frozenset[int]
    _first: np.ndarray  # [ceil(V_lib / 32)] uint32: the tokens the grammar allows first

    def first_allows_any(self, banned: set[int]) -> bool:
        """Whether some token the grammar allows first (EOS included) is not banned."""
        bits = np.unpackbits(self._first.view(np.uint8), bitorder="little")[:self._vocab_size]
        bits[[t for t in banned if t < self._vocab_size]] = 0
        return bool(bits.any())


@dataclass(slots=True)
class _Pending:
    """A compile in progress that other requests for the same spec wait on."""

    done: threading.Event = field(default_factory=threading.Event)
    error: ValueError | None = None


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width, cached and bounded in bytes (each
    entry's estimate, see BYTES_PER_LARK_BYTE): per scope (``GrammarSpec.scope``: the
    tenant's cache group) at most ``cache_size`` entries and ``scope_cache_bytes``, so one
    tenant's many schemas evict only its own; the whole cache at most ``cache_bytes``, the
    least recently used entry of any scope going first past it. A grammar estimated over
    ``max_grammar_bytes`` is refused before compiling."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = 64, cache_bytes: int = 512 << 20,
                 scope_cache_bytes: int = 128 << 20, max_grammar_bytes: int = 64 << 20) -> None:
        if not eos_token_ids or not all(0 <= t < vocab_size for t in eos_token_ids):
            raise ValueError(f"eos_token_ids: need one or more ids below {vocab_size}: {eos_token_ids}")
        # llguidance's vocabulary must cover the tokenizer's; when the model's logits are
        # narrower, Matcher.fill cuts the mask down to them.
        self._lib_vocab = max(vocab_size, tokenizer._tok.get_vocab_size(with_added_tokens=True))
        self._tok = llguidance.LLTokenizer(tokenizer._tok.to_str(), n_vocab=self._lib_vocab,
                                           eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._cache_size = cache_size  # entries per scope (scopes are the configured groups)
        self.cache_bytes, self.scope_cache_bytes = cache_bytes, scope_cache_bytes
        self.max_grammar_bytes = min(max_grammar_bytes, scope_cache_bytes, cache_bytes)
        # (scope, spec) -> (compiled, estimated bytes), least recently used first
        self._cache: OrderedDict[tuple[str, GrammarSpec], tuple[CompiledGrammar, int]] = \
            OrderedDict()
        self._scope_bytes: dict[str, int] = {}
        self._scope_count: dict[str, int] = {}
        self.cached_bytes = 0
        self._lock = threading.Lock()
        self._compiling: dict[tuple[str, GrammarSpec], _Pending] = {}  # specs being compiled
        self._slots = threading.BoundedSemaphore(COMPILE_SLOTS)

    @staticmethod
    def estimate_bytes(spec: GrammarSpec) -> int:
        return GRAMMAR_FLOOR_BYTES + BYTES_PER_LARK_BYTE * len(spec.value)

    def check_size(self, spec: GrammarSpec) -> None:
        """ValueError, before any compile, for a grammar estimated over the size limit."""
        est = self.estimate_bytes(spec)
        if est > self.max_grammar_bytes:
            raise ValueError(f"{spec.kind}: {len(spec.value)} bytes of grammar would take "
                             f"about {est >> 20} MiB compiled, more than the limit of "
                             f"{self.max_grammar_bytes >> 20} MiB")

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled spec (cached); ValueError, with a message for the client, if the spec
        is invalid, too large, or no output can satisfy it. Requests for a spec already
        compiling wait for that compile (one compile a spec, not one a request), and at most
        COMPILE_SLOTS compiles run at once, so memory spent compiling is bounded too."""
        key = (spec.scope, spec)
        while True:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit[0]
                pending = self._compiling.get(key)
                mine = pending is None
                if mine:
                    self.check_size(spec)
                    pending = self._compiling[key] = _Pending()
            if mine:
                break
            pending.done.wait()
            if pending.error is not None:
                raise ValueError(str(pending.error))
            # (compiled and cached: the loop finds it, unless already evicted: then ours)
        try:
            with self._slots:  # unlocked: a slow compile must not hold up matcher()
                compiled = self._compile(spec)
        except ValueError as e:
            pending.error = e
            raise
        finally:
            with self._lock:
                del self._compiling[key]
            pending.done.set()
        with self._lock:
            self._add(key, compiled, self.estimate_bytes(spec))
        return compiled

    def _add(self, key: tuple[str, GrammarSpec], compiled: CompiledGrammar, cost: int) -> None:
        """Insert, then evict least recently used entries: the scope's own past its bounds,
        then anyone's past the whole cache's. O(entries) per eviction; entries are few (the
        bytes bound them, each at least GRAMMAR_FLOOR_BYTES)."""
        scope = key[0]
        self._cache[key] = (compiled, cost)
        self.cached_bytes += cost
        self._scope_bytes[scope] = self._scope_bytes.get(scope, 0) + cost
        self._scope_count[scope] = self._scope_count.get(scope, 0) + 1
        while (self._scope_count[scope] > self._cache_size
               or self._scope_bytes[scope] > self.scope_cache_bytes):
            self._evict(next(k for k in self._cache if k[0] == scope))
        while self.cached_bytes > self.cache_bytes:
            self._evict(next(iter(self._cache)))

    def _evict(self, key: tuple[str, GrammarSpec]) -> None:
        _, cost = self._cache.pop(key)
        self.cached_bytes -= cost
        self._scope_bytes[key[0]] -= cost
        self._scope_count[key[0]] -= 1

    def forget(self, spec: GrammarSpec) -> None:
        """Drop a compiled spec from the cache (its lexer is full: the next request compiles
        it afresh; matchers made from it keep it)."""
        with self._lock:
            if (spec.scope, spec) in self._cache:
                self._evict((spec.scope, spec))

    def matcher(self, spec: GrammarSpec) -> Matcher:
        return Matcher(self.compile(spec))

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            lark = _lark(spec)
        except RecursionError:  # json.loads / dumps of a schema nested too deeply
            raise ValueError(f"{spec.kind}: nested too deeply") from None
        grammar = llguidance.LLMatcher.grammar_from_lark(lark + _OPTIONS)
        m = llguidance.LLMatcher(self._tok, grammar, log_level=0, limits=_LIMITS)
        if m.is_error():
            raise ValueError(_client_message(spec.kind, m.get_error()))
        # The first mask is cheap, warms the lexer and finds grammars that cannot start.
        first = np.frombuffer(m.compute_bitmask(), dtype=np.uint32).copy()
        if m.is_error() or (m.is_stopped() and not m.is_accepting()):
            raise ValueError(f"{spec.kind}: no output can satisfy it")
        allowed_first = first.copy()
        for t in self.eos_token_ids:
            first[t // 32] &= ~np.uint32(1 << (t % 32))
        # Only the empty output (choice [""]): llguidance notices that it cannot go on only
        # once a token has been consumed, so Matcher.is_terminated is told here.
        done_at_start = m.is_accepting() and not first.any()
        return CompiledGrammar(spec, m, done_at_start, self.vocab_size,
                               bitmask_words(self._lib_vocab), self.eos_token_ids, allowed_first)


class Matcher:
    """One sequence's position in a grammar."""

    __slots__ = ("_m", "_done_at_start", "_vocab_size", "_words", "_scratch", "_eos", "_accepted",
                 "_extra_eos")

    def __init__(self, compiled: CompiledGrammar) -> None:
        self._m = compiled._pristine.deep_copy()
        self._done_at_start = compiled._done_at_start
        self._vocab_size = compiled._vocab_size
        self._words = bitmask_words(compiled._vocab_size)
        self._scratch = (None if compiled._lib_words == self._words
                         else np.empty(compiled._lib_words, dtype=np.int32))
        self._eos = compiled._eos
        self._accepted = 0
        self._extra_eos = 0  # EOS ids accepted once llguidance stopped: it records none of them

    @property
    def num_accepted(self) -> int:
        return self._accepted

    @property
    def error(self) -> str | None:
        """llguidance's error once the matcher failed (e.g. past a parser limit), else None."""
        return self._m.get_error() if self._m.is_error() else None

    @property
    def is_terminated(self) -> bool:
        m = self._m
        return ((m.is_stopped() and not m.is_error() and m.is_accepting())
                or (self._accepted == 0 and self._done_at_start))

    def fill(self, words: np.ndarray) -> bool:
        """Set bit t % 32 of words[t // 32] iff token t may come next; False at a dead end
        (then no bit is set)."""
        if words.dtype != np.int32 or words.shape != (self._words,) or not words.flags.c_contiguous:
            # llguidance writes through a raw pointer: a wrong buffer would corrupt memory
            raise ValueError(f"fill: need a contiguous int32 array of {self._words} words")
        m = self._m
        target = words if self._scratch is None else self._scratch
        if not m.is_error():
            m.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        if m.is_error() or (m.is_stopped() and not m.is_accepting()):
            words[:] = 0
            return False
        if self._scratch is not None:
            words[:] = self._scratch[:self._words]
            if self._vocab_size % 32:
                words[-1] &= np.int32((1 << (self._vocab_size % 32)) - 1)
        return np.count_nonzero(words) > 0  # a quarter of words.any()'s cost on short masks

    def accept(self, token_id: int) -> bool:
        """Advance over token_id; False, with no change, if the grammar does not allow it."""
        token_id = int(token_id)  # a torch scalar would hash as a tensor: never in the EOS set
        if not 0 <= token_id < self._vocab_size:
            return False
        m = self._m
        if m.is_stopped():  # complete or failed; llguidance takes no more tokens, not even EOS
            if token_id in self._eos and self.is_terminated:
                self._extra_eos += 1
                self._accepted += 1
                return True
            return False
        if m.try_consume_tokens([token_id]) != 1:  # unlike consume_token, no error state
            return False
        self._accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (any number up to num_accepted)."""
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"rollback: {num_tokens} tokens asked, {self._accepted} accepted")
        extra = min(num_tokens, self._extra_eos)
        self._extra_eos -= extra
        if num_tokens > extra:
            # llguidance lands on a state that took a token after it, so one it had not stopped in
            if not self._m.rollback(num_tokens - extra):
                raise RuntimeError(f"grammar rollback failed: {self._m.get_error()}")
        self._accepted -= num_tokens
