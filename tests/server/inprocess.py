"""The real server (ingress, admission, batcher, executor, supervisor, metrics) in-process, on
a fake model: the test-only hook for fault injection and for load far beyond what the CPU
interpreter could compute.

``FakeRunner.execute`` stands in for the ModelRunner: it samples ``next_token(last, pos)`` (a
function of the sequence only, so outputs are batch-invariant and a solo run is the
reference), and it can be told to fail, hang, or hold steps until released.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import msgspec

from tinyserve.config import EngineConfig, ModelSpec, ServerConfig
from tinyserve.core.engines import EngineInfo
from tinyserve.messages import PLACEHOLDER, SeqOutput, StepPlan, StepResult
from tinyserve.models import STORIES260K
from tinyserve.server import Server
from tinyserve.text.tokenizer import Tokenizer

FIRST_WORD, NUM_WORDS = 259, 253  # stories260k's merged pieces: printable text


def next_token(last: int, pos: int) -> int:
    return FIRST_WORD + (last * 31 + pos * 17) % NUM_WORDS


@dataclass
class FakeRunner:
    """A core.engines.Runner."""

    fills_on_device = True  # (a class attribute: placeholders from its own last step)
    step_seconds: float = 0.0
    fail_next: int = 0  # fail this many steps
    poison: int | None = None  # fail every step that computes this token id
    hang: threading.Event | None = None  # while set to an unset Event, steps block on it
    steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # the last step's sampled tokens: where a placeholder comes from, as the ModelRunner
    # takes them on the device (so the executor launches a step before finishing the last)
    _last: dict[int, int] = field(default_factory=dict)

    def launch(self, plan: StepPlan) -> StepResult:
        """As ModelRunner.launch: placeholders from the last step's tokens (a sequence that
        step did not sample is left out), then the whole step (``execute``, which tests
        override to inject faults); ``finish`` hands the result back."""
        last, self._last = self._last, {}
        seqs = []
        for s in plan.seqs:
            if s.token_ids and s.token_ids[-1] == PLACEHOLDER:
                if s.seq_id not in last:
                    continue
                s = msgspec.structs.replace(s, token_ids=s.token_ids[:-1] + (last[s.seq_id],))
            seqs.append(s)
        result = self.execute(msgspec.structs.replace(plan, seqs=tuple(seqs)))
        self._last = {o.seq_id: o.token_id for o in result.outputs}
        return result

    def finish(self, result: StepResult) -> StepResult:
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        if self.hang is not None:
            self.hang.wait()
        with self.lock:
            self.steps += 1
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("injected step failure")
        if self.poison is not None and any(self.poison in s.token_ids for s in plan.seqs):
            raise RuntimeError("injected failure: poisoned token")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        outs = []
        for s in plan.seqs:
            if not s.sample:
                continue
            end = s.start_pos + len(s.token_ids)
            tok = next_token(s.token_ids[-1], end)
            top = None if s.params.logprobs is None else tuple(
                (FIRST_WORD + i, -1.0 - i) for i in range(s.params.logprobs))
            outs.append(SeqOutput(s.seq_id, tok, -0.5, top))
        return StepResult(plan.step_id, tuple(outs))


class GuidedFakeRunner(FakeRunner):
    """A FakeRunner that keeps to a request's constraints as the ModelRunner does: the
    engine's LogitsProcessors over a real llguidance compiler (stories260k's tokenizer) fill
    the masks, the drawn token is ``next_token`` moved to the next id the mask and the -100 /
    min_tokens bans allow, and a row they leave nothing for ends as the runner ends it."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        import torch

        from tinyserve.engine.running.logits_processing import LogitsProcessors
        from tinyserve.text.grammar import GrammarCompiler

        tok = Tokenizer(STORIES260K)
        self.grammars = GrammarCompiler(tok, 512, tok.eos_token_ids)
        self.logits = LogitsProcessors(512, tuple(tok.eos_token_ids), torch.device("cpu"))
        self.logits.grammars = self.grammars

    def execute(self, plan: StepPlan) -> StepResult:
        import numpy as np

        self.logits.forget(plan.freed)
        base = super().execute(plan)
        seqs = [s for s in plan.seqs if s.sample]
        masks, failed = self.logits.grammar_masks(seqs)
        ends = self.logits.dead_ends(seqs, masks, failed)
        tokens, outs = [], []
        for i, (s, out) in enumerate(zip(seqs, base.outputs, strict=True)):
            end = ends.get(i)
            if end is not None and not isinstance(end, int):
                tokens.append(-1)
                outs.append(SeqOutput(s.seq_id, -1, 0.0, error=end[1], error_reason=end[0]))
                continue
            allowed = np.ones(512, bool)
            if masks is not None and s.params.guided is not None:
                allowed = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:512] > 0
            allowed[[t for t, b in s.params.logit_bias if b <= -100.0]] = False
            allowed[list(s.banned)] = False
            ids = np.flatnonzero(allowed)
            tok = end if end is not None else int(
                next((t for t in ids if t >= out.token_id), ids[0]))
            tokens.append(tok)
            outs.append(msgspec.structs.replace(out, token_id=tok))
        if masks is not None:
            self.logits.advance(seqs, tokens)
        return StepResult(plan.step_id, tuple(outs))


class FakeEngine:
    """A core.engines.Engine on a fake runner (nothing to warm up)."""

    def __init__(self, runner: FakeRunner, max_model_len: int = 128, num_kv_blocks: int = 512,
                 block_size: int = 16) -> None:
        self.runner = runner
        # the API compiles with the runner's cache (a GuidedFakeRunner's), else none
        self.grammars = runner.grammars if isinstance(runner, GuidedFakeRunner) else None
        self.tokenizer = Tokenizer(STORIES260K)
        self.info = EngineInfo(
            model_path=str(STORIES260K), device="cpu", dtype="float32", quantization=None,
            kv_cache_dtype="auto",
            vocab_size=512, max_model_len=max_model_len, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_bytes=0, weight_bytes=0,
            weight_bytes_unquantized=0, eos_token_ids=frozenset({2}), random_weights=False)

    def warm_up(self) -> dict:
        return {}


class InProcessServer:
    """A Server on its own event loop thread; ``url`` is where it listens."""

    def __init__(self, runner: FakeRunner | None = None, *, max_model_len: int = 128,
                 num_kv_blocks: int = 512, models: dict[str, FakeRunner] | None = None,
                 engine=None, freeze_heap: bool = False, use_uvloop: bool = False,
                 **cfg) -> None:
        """``models``: several served models by name, each on its own fake runner (default:
        one, ``stories260k``, on ``runner``). ``engine``: a real DeviceEngine to serve instead (as
        ``stories260k``). ``freeze_heap``: freeze the process's heap once loaded, as
        ``python -m tinyserve`` does (for latency measurements; undone by ``stop``).
        ``use_uvloop``: the event loop ``python -m tinyserve`` runs (benchmarks)."""
        self.runners = models or {"stories260k": runner or FakeRunner()}
        self.runner = next(iter(self.runners.values()))
        engine_keys = {"max_num_seqs", "max_num_batched_tokens", "block_size"}
        ecfg = EngineConfig(**{k: v for k, v in cfg.items() if k in engine_keys})
        scfg = ServerConfig(port=0, **{k: v for k, v in cfg.items() if k not in engine_keys})
        engines = {name: FakeEngine(r, max_model_len, num_kv_blocks, ecfg.block_size)
                   for name, r in self.runners.items()}
        if engine is not None:
            engines = {"stories260k": engine}
        if use_uvloop:
            import uvloop
            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        self.server = Server(scfg, [ModelSpec(name, ecfg) for name in self.runners], engines,
                             freeze_heap=freeze_heap)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self._start())
        self.url = f"http://127.0.0.1:{self.server.port}"

    async def _start(self) -> None:
        await self.server.start_http()
        await self.server.load()

    def call(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop (to read its state there) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def snapshot(self) -> dict:
        """running, waiting, KV usage and requests held, read on the server's own loop."""
        async def read():
            cores = [b.core for b in self.server.batchers.values()]
            return {"running": sum(c.scheduler.num_running for c in cores),
                    "waiting": sum(c.scheduler.num_waiting for c in cores),
                    "kv_usage": sum(c.kv.usage for c in cores),
                    "requests": sum(len(c.requests) for c in cores),
                    "live": self.server.api.num_live}
        return self.call(read())

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            if not any(snap.values()) or time.monotonic() > deadline:
                return snap
            time.sleep(0.05)

    def stop(self) -> None:
        for runner in self.runners.values():
            if runner.hang is not None:
                runner.hang.set()  # let a wedged step's thread end
        try:
            self.call(self.server.close(), timeout=30)  # (closing twice is harmless)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
