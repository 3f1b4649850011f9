"""SmolLM2-135M-Instruct (the real GGUF file, Q4_1 with a Q8_0 embedding; .ci/run fetches it)
against transformers' GGUF load of the same file (dequantized to fp32): full-vocabulary
logprobs over a teacher-forced text with the weights kept in their GGUF forms and dequantized,
and a chat through the server (the file's ChatML template, streamed). The longer checks (a
200-token text, greedy 48 tokens on 4 chats, tools and JSON schema output through the OpenAI
client) are loadtest/check_smollm2.py's: minutes on this CPU."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tests.engine.test_model_vs_transformers import rel_l2, run_chunk  # noqa: E402
from tinyserve.llm import LLM  # noqa: E402

TEXT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "went out every morning before the sun rose. One day he found a bottle in his net.")


@pytest.fixture(scope="module")
def smollm2(smollm2_file):
    path = smollm2_file
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return path, hf, tok


@pytest.mark.parametrize("dequantize", [False, True], ids=["kept", "dequantized"])
def test_full_vocabulary_logprobs_equal_transformers(smollm2, dequantize):
    path, hf, tok = smollm2
    ids = tok(TEXT)["input_ids"][:48]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double()
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8, max_model_len=128,
              dequantize=dequantize)
    got = run_chunk(llm.engine, 0, ids, 0, [1, 2, 3]).double()
    assert rel_l2(got, ref) < 1e-4
    # Q4_1 kept in the int4 kernel is exact (W = q * d + m): the same bound as dequantized
    assert (got.log_softmax(-1) - ref.log_softmax(-1)).abs().max() < 2e-4
    assert llm.engine.runner.model.w.quantization == (None if dequantize else "gguf")


def test_a_chat_through_the_server(smollm2):
    """The prompt the file's ChatML template makes, as transformers makes it, and the
    model's first tokens streamed back for a question it answers."""
    from tests.server.helpers import chat, run, stream
    from tests.server.inprocess import InProcessServer
    from tinyserve.config import EngineConfig
    from tinyserve.engine.device_engine import DeviceEngine

    path, hf, tok = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(want, list):
        want = want["input_ids"]
    with torch.no_grad():
        out = hf.generate(torch.tensor([want]), max_new_tokens=3, do_sample=False)
    expected = tok.decode(out[0, len(want):])
    engine = DeviceEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16,
                                       max_model_len=256))
    srv = InProcessServer(engine=engine, max_num_seqs=2)
    try:
        body = chat("What is the capital of France?", max_tokens=3,
                    stream_options={"include_usage": True})
        events, done, _ = run(stream(srv.url, "/v1/chat/completions", body))
    finally:
        srv.stop()
    assert done
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert usage["prompt_tokens"] == len(want) and usage["completion_tokens"] == 3
    assert text == expected and text.startswith("The capital")
