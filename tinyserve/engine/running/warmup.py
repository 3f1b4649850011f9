"""The runner's warm-up: before the server reports ready, launch every kernel specialization
serving will use, so that no Triton compile (or CUDA-graph capture) lands inside a step.

Decode buckets x split classes are recorded (captured on a GPU); the sampling kernel runs in
every variant at every bucket size; eager steps run in the shapes that change a Triton
specialization (integer arguments equal to 1 or a multiple of 16 are specialized); the
block-table update runs for 1, 16 and 17 entries. ``tests/kernels/gpu_compile_check.py
--warm-up`` checks with the GPU's launch configurations that serving needs nothing more.
"""

from __future__ import annotations

import logging
import time

import torch

from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.running.runner import ModelRunner
from tinyserve.kernels import sample, target_logprobs
from tinyserve.kernels.utils import INTERPRET
from tinyserve.messages import SamplingParams, ScheduledSeq

log = logging.getLogger(__name__)

# Sampling variants the warm-up runs: (all_greedy, any_top_k, any_top_p, top logprobs).
SAMPLING_VARIANTS = ((True, False, False, 0), (False, False, False, 0), (False, True, False, 0),
                     (False, False, True, 0), (False, True, True, 0), (True, False, False, 2))


# A draw with every kind of logits processing (warms the penalties kernel).
_PENALIZED = ScheduledSeq(0, (0,), 0, (), True, SamplingParams(
    presence_penalty=0.5, repetition_penalty=1.1, logit_bias={0: 1.0}, min_tokens=1), 0,
    output_ids=(0,), prompt_ids=(0,), banned=(0,))


def warm_up(runner: ModelRunner, compile_all: bool | None = None) -> dict:
    """Record (and on a GPU capture) every decode bucket, run every sampling variant at
    every bucket size and the eager shapes of ``eager_warm_shapes``, so that no kernel
    specialization is compiled while serving.

    ``compile_all`` (default: not under the interpreter): the interpreter compiles nothing
    and a bucket recorded on first use costs that step nothing extra (the recording run
    is the step), so on the CPU the warm-up does nothing unless asked to."""
    t0 = time.perf_counter()
    if compile_all is None:
        compile_all = not INTERPRET
    if not compile_all:
        log.info("warm-up: interpreter, nothing to compile; decode buckets %s are recorded "
                 "on first use", list(runner.buckets.sizes))
        return {"buckets": [], "cuda_graphs": False, "sampling_variants": 0,
                "eager_shapes": 0, "scratch_mib": 0.0, "seconds": 0.0,
                "capacity": runner.statics.cap}
    st = runner.statics
    for n in (1, 16, 17):  # the block-table update: each size its own specialization
        if n <= st.max_updates:  # (block 0 into the padding row, which holds zeros anyway)
            runner.push_table_updates([(runner.tables.pad_row, 0, 0)] * n, statics=False)
    shapes = eager_warm_shapes(runner)
    for dec_lens, pre_lens in shapes:
        _warm_eager(runner, dec_lens, pre_lens)
    cap = st.cap
    st.pad_rows(0, cap, runner.tables.pad_row)  # every row padding: the recordings run on it
    st.push(0)
    for B in runner.buckets.sizes:
        for max_len in runner.buckets.split_classes():
            runner.record_bucket(B, max_len)
    graphs = runner.buckets.capture()  # all at once: one sync, one cleanup, one pool
    sizes = runner.buckets.sizes or tuple(sorted({min(n, runner.max_num_seqs) for n in (1, 2, 16)}))
    launches = 0
    for B in sizes:
        logits = torch.zeros((B, runner.cfg.vocab_size), dtype=torch.float32, device=runner.device)
        words = torch.full((B, -(-runner.cfg.vocab_size // 32)), -1, dtype=torch.int32,
                           device=runner.device)
        for greedy, top_k, top_p, n_top in SAMPLING_VARIANTS:
            # as is, after penalties (a processed copy), under a grammar mask, both
            for processed, allowed in ((None, None), (logits, None), (None, words),
                                       (logits, words)):
                sample(logits, *runner.sampling_tensors(B), n_top, all_greedy=greedy,
                       any_top_k=top_k, any_top_p=top_p, processed=processed, allowed=allowed)
                launches += 1
        targets = torch.zeros(B, dtype=torch.int64, device=runner.device)
        for n_top in (0, 2):  # prompt logprobs (echo, prompt_logprobs)
            target_logprobs(logits, targets, n_top)
            launches += 1
        runner.logits.processed(logits, [_PENALIZED] * B)  # (last: it bans token 0 in place)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    info = {"buckets": list(runner.buckets.sizes), "split_classes": runner.buckets.split_classes(),
            "recordings": len(runner.buckets.recorded), "cuda_graphs": runner.buckets.use_graphs,
            "graphs_captured": graphs["graphs"], "graph_seconds": graphs["seconds"],
            "graph_memory_mib": graphs["memory_mib"],
            "sampling_variants": launches, "eager_shapes": len(shapes),
            "scratch_mib": round(runner.buckets.scratch_bytes / 2**20, 1),
            "seconds": round(time.perf_counter() - t0, 2), "capacity": cap}
    captured = (f" and captured as {graphs['graphs']} CUDA graphs in {graphs['seconds']:.2f} s"
                f" ({graphs['memory_mib']:.1f} MiB)") if runner.buckets.use_graphs else ""
    log.info("warm-up: %d decode buckets %s x %d split classes recorded%s, %d sampling "
             "variants, %d eager shapes, %.1f MiB scratch, %.2f s", len(runner.buckets.sizes),
             list(runner.buckets.sizes), len(runner.buckets.split_classes()), captured, launches,
             len(shapes), info["scratch_mib"], info["seconds"])
    return info


def eager_warm_shapes(runner: ModelRunner) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(decode lengths, prefill chunk lengths) of the eager steps the warm-up runs. Triton
    specializes an integer argument on being 1 or a multiple of 16, so: chunks of 16 and
    17 tokens alone, 16 rows sampled of 32; then 1, 2, 15 and 16 decodes beside a 16-token
    chunk (2 to 17 rows sampled), each at one KV split and at several when max_model_len
    allows them.
    (tests/kernels/gpu_compile_check.py --warm-up checks that serving needs no more.)"""
    from tinyserve.kernels.attention_decode import default_split_size

    split, longest = default_split_size(), runner.max_model_len
    lengths = [min(split, longest)] + ([longest] if longest > split else [])
    shapes = [((), (16,)), ((), (17,)), ((lengths[0],) * 15, (17,))]  # (16 rows of 32)
    for n in (1, 2, 15, 16):
        shapes += [((length,) * n, (16,)) for length in lengths]
        if not runner.buckets.sizes:  # eager decode-only steps too
            shapes += [((length,) * n, ()) for length in lengths]
    return shapes


def _warm_eager(runner: ModelRunner, dec_lens: tuple[int, ...], pre_lens: tuple[int, ...]) -> None:
    """One eager forward pass of that shape on nothing: every row reads the all-zero padding
    row of the block table and writes no KV (slot -1)."""
    dev, pad = runner.device, runner.tables.pad_row
    T = len(dec_lens) + sum(pre_lens)
    q_start = [0]
    for n in pre_lens:
        q_start.append(q_start[-1] + n)

    def ints(values, dtype=torch.int32):
        return torch.tensor(list(values), dtype=dtype, device=dev)

    batch = ForwardBatch(
        input_ids=ints([0] * T, torch.int64), positions=ints([0] * T, torch.int64),
        slot_mapping=ints([-1] * T, torch.int64), num_decodes=len(dec_lens),
        block_tables=runner.table_dev, decode_rows=ints([pad] * len(dec_lens)),
        decode_seq_lens=ints(dec_lens), decode_max_seq_len=max(dec_lens, default=0),
        prefill_rows=ints([pad] * len(pre_lens)), prefill_seq_lens=ints(pre_lens),
        prefill_q_start=ints(q_start), prefill_max_q_len=max(pre_lens, default=0),
        logits_indices=ints(list(range(len(dec_lens))) + [len(dec_lens) + q - 1
                                                           for q in q_start[1:]], torch.int64),
        # with adapters, every row on slot 0 (whatever it holds: the outputs are not read)
        lora_slots=None if runner.model.lora is None else ints([0] * T))
    logits = runner.model.forward(batch, runner.kv_cache)
    sample(logits, *runner.sampling_tensors(logits.shape[0]), 0, all_greedy=True)
