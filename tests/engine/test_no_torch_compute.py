"""torch allocates and views; every computation on the hot path is a Triton kernel.

One full engine step (prefill + decode, sampling included) runs under a TorchDispatchMode that
records every aten op torch executes; anything outside the allow-list fails the test.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tinyserve.config import EngineConfig
from tinyserve.core.engine_core import CoreConfig, EngineCore
from tinyserve.engine.device_engine import DeviceEngine
from tinyserve.messages import GrammarSpec, SamplingParams

# Allocation, views, copies (host<->device, and the interpreter's own argument staging).
ALLOWED = {
    "empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
    "view.default", "_unsafe_view.default", "slice.Tensor", "select.int", "as_strided.default",
    "alias.default", "detach.default", "lift_fresh.default", "_to_copy.default", "copy_.default",
    "set_.source_Storage", "set_.source_Storage_storage_offset",
}


class RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(f"{func.overloadpacket.__name__}.{func._overloadname}")
        return func(*args, **(kwargs or {}))


def test_engine_step_runs_no_torch_compute(tmp_path):
    from tinyserve.engine.loading.demo import DEMO_CONFIG, write_random_llama, write_tokenizer

    write_random_llama(tmp_path, DEMO_CONFIG)
    write_tokenizer(tmp_path)
    cfg = EngineConfig(model=str(tmp_path), num_kv_blocks=16, max_model_len=128)
    engine = DeviceEngine(cfg)
    core = EngineCore(CoreConfig.from_engine(cfg, engine.info), engine.tokenizer)
    core.add_request(1, [256, 1, 2, 3, 4, 5], SamplingParams(max_tokens=3, temperature=0.0))
    core.add_request(2, [256, 9, 8], SamplingParams(max_tokens=3, temperature=0.9, top_k=5,
                                                    top_p=0.8, logprobs=2))
    # penalties and logit_bias, a grammar mask, prompt logprobs: all on the sampling path
    core.add_request(3, [256, 7, 7, 7], SamplingParams(
        max_tokens=3, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3,
        repetition_penalty=1.2, logit_bias={5: 2.0}, min_tokens=2, logprobs=1,
        prompt_logprobs=2))
    core.add_request(4, [256, 3], SamplingParams(max_tokens=3, temperature=0.7,
                                                 guided=GrammarSpec("regex", "[a-z]+")))
    steps = 0
    with RecordOps() as rec:
        while core.has_unfinished:
            plan = core.schedule()
            core.process(plan, engine.runner.execute(plan))
            steps += 1
    assert steps >= 3  # prefill, then decodes
    assert rec.ops, "the dispatch mode saw nothing: the test would be vacuous"
    assert rec.ops <= ALLOWED, f"torch computed on the hot path: {sorted(rec.ops - ALLOWED)}"


def test_the_recorder_does_see_torch_compute():
    with RecordOps() as rec:
        (torch.ones(3) * 2).sum()
    assert not rec.ops <= ALLOWED
