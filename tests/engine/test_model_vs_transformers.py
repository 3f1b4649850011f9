"""The whole Triton forward pass against transformers' LlamaForCausalLM (float32).

Random-weight checkpoints are built here with transformers itself and saved in Hugging Face
layout, so loading (fused projections, rope settings, tied embeddings) is checked too.
Agreement is relative L2 error of the logits < 1e-4, over every position computed.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tinyserve.config import EngineConfig  # noqa: E402
from tinyserve.engine.device_engine import DeviceEngine  # noqa: E402
from tinyserve.engine.loading.demo import write_tokenizer  # noqa: E402
from tinyserve.messages import SamplingParams, ScheduledSeq  # noqa: E402

BLOCK = 16
CONFIGS = {
    # GQA 4:1 with llama3 rope scaling, written in transformers 5's `rope_parameters` form.
    "gqa_llama3": dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=256, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32}),
    # Tied embeddings, no GQA, odd sizes; config rewritten below in the classic rope_theta form.
    "tied_classic": dict(vocab_size=259, hidden_size=48, intermediate_size=100, num_hidden_layers=3,
                         num_attention_heads=6, num_key_value_heads=6, head_dim=8,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(initializer_range=0.15, rms_norm_eps=1e-5, **CONFIGS[name])
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    write_tokenizer(path)
    if name == "tied_classic":  # the pre-transformers-5 key layout most published checkpoints use
        raw = json.loads((path / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope["rope_theta"]
        raw["rope_scaling"] = None
        (path / "config.json").write_text(json.dumps(raw))
    engine = DeviceEngine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=BLOCK,
                                       dtype="float32"))  # (auto: bf16 on a GPU)
    return hf, engine


def rel_l2(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run_chunk(engine, seq_id, ids, start, blocks, all_rows=True):
    """Run tokens ids[start:] of one sequence; return logits for every computed row."""
    s = ScheduledSeq(seq_id=seq_id, token_ids=tuple(ids[start:]), start_pos=start,
                     new_blocks=tuple(blocks), sample=True, params=SamplingParams(), seed=0)
    return run_step(engine, [s])[0]


def run_step(engine, seqs: list[ScheduledSeq]) -> list[torch.Tensor]:
    """One forward step over several sequences; logits for all rows, split per sequence."""
    runner = engine.runner
    ordered = sorted(seqs, key=lambda s: len(s.token_ids) != 1)
    rows, updates = runner.tables.apply((), ordered)  # (first_block 0: whole tables)
    runner.push_table_updates(updates, statics=False)
    batch, _ = runner.pack(ordered, rows)
    T = batch.input_ids.shape[0]
    batch = dataclasses.replace(batch, logits_indices=torch.arange(T, device=runner.device))
    logits = runner.model.forward(batch, runner.kv_cache)
    out, row = {}, 0
    for s in ordered:
        out[s.seq_id] = logits[row:row + len(s.token_ids)].cpu()
        row += len(s.token_ids)
    return [out[s.seq_id] for s in seqs]


def test_prefill_then_decode_matches_transformers(checkpoint):
    hf, engine = checkpoint
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (45,), generator=g).tolist()
    ref = hf_logits(hf, ids)
    blocks = [7, 2, 9, 4]  # scattered physical blocks
    prefill = run_chunk(engine, 0, ids[:40], 0, blocks)
    assert rel_l2(prefill, ref[:40]) < 1e-4
    for pos in range(40, 45):  # decode steps, one token each, crossing no block edge at 48
        step = run_chunk(engine, 0, ids[: pos + 1], pos, blocks)
        assert step.shape[0] == 1
        assert rel_l2(step[0], ref[pos]) < 1e-4, pos


def test_chunked_and_prefix_cached_prefill_matches_transformers(checkpoint):
    hf, engine = checkpoint
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, hf.config.vocab_size, (70,), generator=g).tolist()
    ref = hf_logits(hf, ids)
    blocks = [11, 3, 20, 5, 30]
    # Three chunks, the way chunked prefill (or a 32-token prefix-cache hit) runs them.
    for lo, hi in [(0, 32), (32, 33), (33, 70)]:
        got = run_chunk(engine, 0, ids[:hi], lo, blocks)
        assert rel_l2(got, ref[lo:hi]) < 1e-4, (lo, hi)


def test_mixed_batch_of_decodes_and_prefills_matches_transformers(checkpoint):
    hf, engine = checkpoint
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, hf.config.vocab_size, (20,), generator=g).tolist()
    b = torch.randint(0, hf.config.vocab_size, (37,), generator=g).tolist()
    c = torch.randint(0, hf.config.vocab_size, (9,), generator=g).tolist()
    tables = {0: [40, 41], 1: [42, 43, 44], 2: [45]}
    run_chunk(engine, 0, a[:19], 0, tables[0])  # a and b are already partly in the cache
    run_chunk(engine, 1, b[:16], 0, tables[1])
    mk = lambda sid, ids, start: ScheduledSeq(sid, tuple(ids[start:]), start, tuple(tables[sid]),
                                              True, SamplingParams(), 0)
    out = run_step(engine, [mk(1, b, 16), mk(0, a, 19), mk(2, c, 0)])  # prefill, decode, prefill
    assert rel_l2(out[0], hf_logits(hf, b)[16:]) < 1e-4
    assert rel_l2(out[1], hf_logits(hf, a)[19:]) < 1e-4
    assert rel_l2(out[2], hf_logits(hf, c)) < 1e-4
