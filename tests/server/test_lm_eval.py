"""Acceptance: lm-evaluation-harness's ``local-completions`` scores a task through the server.

lm-eval sends each (context, continuation) pair as token ids with ``echo: true, logprobs: 1,
max_tokens: 1`` and reads the continuation's log-likelihood from ``logprobs.token_logprobs``
(``is_greedy`` from ``top_logprobs``). The server's numbers must equal transformers' float32
forward pass and the offline engine's ``prompt_logprobs`` to 1e-4 per request.

The task (tests/data/lm_eval/tinystories_cloze.yaml): 8 TinyStories-style stories, 3 next
words each, 24 loglikelihood requests. Needs ``pip install "lm-eval[api]"``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from tests.server.inprocess import InProcessServer  # noqa: E402

TASK_DIR = Path(__file__).parents[1] / "data" / "lm_eval"
TASK = "tinystories_cloze"
MODEL = "stories260k"  # the name InProcessServer serves the engine under
TOL = 1e-4
GREEDY_MARGIN = 1e-3  # is_greedy is only compared where the top two logits are this far apart


@pytest.fixture(scope="module")
def server(stories_dir):
    from tinyserve.config import EngineConfig
    from tinyserve.engine.device_engine import DeviceEngine

    engine = DeviceEngine(EngineConfig(model=str(stories_dir), dtype="float32", num_kv_blocks=64,
                                 max_model_len=256))
    srv = InProcessServer(engine=engine, max_num_seqs=16)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def harness(server, stories_dir):
    """Run lm-eval once; record every payload it sent and every response it parsed."""
    payloads, parsed = [], []
    create, parse = LocalCompletionsAPI._create_payload, LocalCompletionsAPI.parse_logprobs

    def recording_create(self, *args, **kwargs):
        payload = create(self, *args, **kwargs)
        payloads.append(payload)
        return payload

    def recording_parse(outputs, tokens=None, ctxlens=None, **kwargs):
        res = parse(outputs=outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)
        parsed.append((outputs, [list(t) for t in tokens], list(ctxlens), res))
        return res

    results, error = None, None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LocalCompletionsAPI, "_create_payload", recording_create)
        mp.setattr(LocalCompletionsAPI, "parse_logprobs", staticmethod(recording_parse))
        try:
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={
                    "model": MODEL,
                    "base_url": server.url + "/v1/completions",
                    "tokenizer_backend": "huggingface",
                    "tokenizer": str(stories_dir),
                    "add_bos_token": True,  # stories260k was trained with BOS first
                    "batch_size": 4,  # several prompts per request (prompt: [[ids], [ids], ...])
                    "num_concurrent": 3,  # and several requests at once
                    "max_retries": 1,
                    "timeout": 120,
                },
                tasks=[TASK],
                task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
                log_samples=True,
                bootstrap_iters=0,
            )
        except Exception as e:  # the payload test still runs; the others re-raise this
            error = e
    # (tokens, ctxlen) -> (loglikelihood, is_greedy), as lm-eval parsed them
    scored = {}
    for _, tokens, ctxlens, res in parsed:
        for t, c, r in zip(tokens, ctxlens, res, strict=True):
            scored[(tuple(t), c)] = r
    return {"results": results, "error": error, "payloads": payloads, "parsed": parsed,
            "scored": scored}


def completed(harness) -> dict:
    if harness["error"] is not None:
        raise harness["error"]
    return harness


@pytest.fixture(scope="module")
def hf_model(stories_dir):
    model = transformers.LlamaForCausalLM.from_pretrained(str(stories_dir), dtype=torch.float32)
    return model.eval()


def hf_score(model, tokens: list[int], ctxlen: int) -> tuple[float, bool, bool]:
    """(log-likelihood of tokens[ctxlen:] given the rest, is_greedy, greedy_is_clear)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    ll, greedy, clear = 0.0, True, True
    for i in range(ctxlen, len(tokens)):
        ll += float(lp[i - 1, tokens[i]])
        top2 = torch.topk(logits[i - 1], 2)
        greedy &= int(top2.indices[0]) == tokens[i]
        clear &= float(top2.values[0] - top2.values[1]) > GREEDY_MARGIN
    return ll, greedy, clear


def test_lm_eval_sends_token_ids_with_echo_and_logprobs(harness):
    payloads = harness["payloads"]
    assert payloads
    for p in payloads:
        assert p["model"] == MODEL and p["echo"] is True and p["logprobs"] == 1
        assert p["max_tokens"] == 1 and p["temperature"] == 0
        assert all(isinstance(t, list) and t[0] == 1 for t in p["prompt"])  # ids, BOS first


def test_echoed_prompt_logprobs_have_the_openai_shape(harness):
    harness = completed(harness)
    for outputs, tokens, _, _ in harness["parsed"]:
        for out in outputs if isinstance(outputs, list) else [outputs]:
            choices = sorted(out["choices"], key=lambda c: c["index"])
            assert len(choices) == len(tokens)
            for choice, toks in zip(choices, tokens, strict=True):
                lp = choice["logprobs"]
                # every prompt token echoed, then the one generated token
                assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(toks) + 1
                assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
                assert all(x is not None for x in lp["token_logprobs"][1:])
                assert all(len(t) >= 1 for t in lp["top_logprobs"][1:])


def test_server_loglikelihoods_equal_transformers(harness, hf_model):
    harness = completed(harness)
    scored = harness["scored"]
    assert len(scored) == 24  # 8 stories x 3 choices, all distinct
    for (tokens, ctxlen), (ll, is_greedy) in scored.items():
        ref, greedy, clear = hf_score(hf_model, list(tokens), ctxlen)
        assert math.isclose(ll, ref, abs_tol=TOL), (tokens, ctxlen, ll, ref)
        if clear:
            assert is_greedy == greedy, (tokens, ctxlen)


def test_samples_and_accuracy_come_from_those_loglikelihoods(harness, hf_model, stories_dir):
    """log_samples' resps are the server's numbers, and acc is what transformers' would give."""
    harness = completed(harness)
    results = harness["results"]
    samples = results["samples"][TASK]
    assert len(samples) == 8
    tok = transformers.AutoTokenizer.from_pretrained(str(stories_dir))
    correct = 0
    for s in samples:
        lls = []
        for (context, continuation), resp in zip(s["arguments"], s["resps"], strict=True):
            whole = tok(context + continuation).input_ids  # BOS + context + continuation
            ctxlen = len(tok(context).input_ids)
            ll, is_greedy = resp[0]
            assert (ll, is_greedy) == tuple(harness["scored"][(tuple(whole), ctxlen)])
            lls.append(hf_score(hf_model, whole, ctxlen)[0])
        correct += max(range(len(lls)), key=lls.__getitem__) == s["doc"]["label"]
    assert results["results"][TASK]["acc,none"] == pytest.approx(correct / len(samples))


def test_server_loglikelihoods_equal_offline_prompt_logprobs(harness, stories_dir):
    """The offline engine, with vLLM's prompt_logprobs, scores the same token lists alike."""
    harness = completed(harness)
    from tinyserve import LLM, SamplingParams

    llm = LLM(str(stories_dir), dtype="float32")
    keys = list(harness["scored"])
    outs = llm.generate([list(t) for t, _ in keys],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    for (tokens, ctxlen), out in zip(keys, outs, strict=True):
        plp = out.prompt_logprobs
        assert len(plp) == len(tokens) and plp[0] is None
        assert all(tokens[i] in plp[i] for i in range(1, len(tokens)))
        ll = sum(plp[i][tokens[i]] for i in range(ctxlen, len(tokens)))
        greedy = all(plp[i][tokens[i]] == max(plp[i].values()) for i in range(ctxlen, len(tokens)))
        server_ll, server_greedy = harness["scored"][(tokens, ctxlen)]
        assert math.isclose(ll, server_ll, abs_tol=TOL), (tokens, ctxlen, ll, server_ll)
        assert greedy == server_greedy, (tokens, ctxlen)
