"""The draft model of ``--speculative-config '{"method": "draft_model", ...}'``: a smaller
model (or a quantized copy of the target: an int4 self-draft) that proposes the K tokens a
verify step checks.

Its KV cache is its own tensors, paged by the target's block table: the same block ids and
slots, so the scheduler's allocation (K + 1 positions a verify) covers both, and a block
freed for the target is freed for the draft. A verify entry tells how far the draft's cache
is valid (``draft_from``: the scheduler tracks it) and carries the tokens from there to the
last (``draft_prefix``); the proposal is then K greedy steps of the draft:

    step 0:  draft_prefix + [t_p]  at positions draft_from .. p      -> d1  (argmax)
    step r:  d_r                   at position  p + r                -> d_{r+1}

A proposal is the draft's argmax: a point mass, so the target's verify accepts d exactly when
its own draw is d (speculation.py). Greedy drafting is what lets acceptance reuse the
target's seeded draw; a sampled draft would need its probabilities for the min(1, q / p)
test (not done here).
"""

from __future__ import annotations

import msgspec
import torch

from tinyserve.engine.model.batch import ForwardBatch
from tinyserve.engine.model.decoder import DecoderModel
from tinyserve.engine.model.kv_cache import KVCache
from tinyserve.engine.running.packing import pack_arrays
from tinyserve.engine.running.staging import stage
from tinyserve.kernels import sample
from tinyserve.messages import SamplingParams, ScheduledSeq

_GREEDY = SamplingParams(temperature=0.0)


class DraftProposer:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.num_forwards = 0  # draft forward passes run (benchmarks)

    def propose(self, entries: list[ScheduledSeq], rows: list[int], table_host,
                table_dev: torch.Tensor, block_size: int) -> list[ScheduledSeq]:
        """The verify entries with their drafts filled in (token_ids[1:]), proposed in K
        batched greedy steps; ``rows``: each entry's row in the block table."""
        if not entries:
            return entries
        K = max(e.num_drafts for e in entries)
        inputs = [ScheduledSeq(e.seq_id, e.draft_prefix + e.token_ids[:1], e.draft_from, (),
                               True, _GREEDY, 0) for e in entries]
        drafts: list[list[int]] = [[] for _ in entries]
        live = list(range(len(entries)))
        for r in range(K):
            tokens = self._step([inputs[i] for i in live], [rows[i] for i in live],
                                table_host, table_dev, block_size)
            nxt = []
            for i, t in zip(live, tokens, strict=True):
                drafts[i].append(t)
                if len(drafts[i]) < entries[i].num_drafts:
                    e = entries[i]
                    inputs[i] = ScheduledSeq(e.seq_id, (t,), e.start_pos + r + 1, (), True,
                                             _GREEDY, 0)
                    nxt.append(i)
            live = nxt
            if not live:
                break
        return [msgspec.structs.replace(e, token_ids=e.token_ids[:1] + tuple(d))
                for e, d in zip(entries, drafts, strict=True)]

    def _step(self, seqs: list[ScheduledSeq], rows: list[int], table_host,
              table_dev: torch.Tensor, block_size: int) -> list[int]:
        """One greedy token per entry, in the entries' order."""
        # the forward pass takes decodes first (packing.py): step 0 mixes catch-ups (a
        # draft_prefix) with single tokens in the plan's order
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) != 1)
        tokens = self._forward([seqs[i] for i in order], [rows[i] for i in order], table_host,
                               table_dev, block_size)
        out = [0] * len(seqs)
        for j, i in enumerate(order):
            out[i] = tokens[j]
        return out

    def _forward(self, seqs: list[ScheduledSeq], rows: list[int], table_host,
                 table_dev: torch.Tensor, block_size: int) -> list[int]:
        arrays, sampled, _, meta = pack_arrays(seqs, rows, table_host, block_size, {})
        ids, pos, slots, logits_idx, dec_rows, dec_lens, pre_rows, pre_lens, q_start = \
            stage(arrays, self.device)
        batch = ForwardBatch(
            input_ids=ids, positions=pos, slot_mapping=slots, num_decodes=meta["num_decodes"],
            block_tables=table_dev, decode_rows=dec_rows, decode_seq_lens=dec_lens,
            decode_max_seq_len=meta["decode_max_seq_len"], prefill_rows=pre_rows,
            prefill_seq_lens=pre_lens, prefill_q_start=q_start,
            prefill_max_q_len=meta["prefill_max_q_len"], logits_indices=logits_idx)
        logits = self.model.forward(batch, self.kv_cache)
        n = logits.shape[0]
        zeros_f = torch.zeros(n, dtype=torch.float32, device=self.device)
        tokens, _, _, _ = sample(logits, zeros_f, torch.zeros(n, dtype=torch.int32,
                                                              device=self.device),
                                 torch.ones(n, dtype=torch.float32, device=self.device),
                                 torch.zeros(n, dtype=torch.int64, device=self.device), 0,
                                 all_greedy=True, any_top_k=False, any_top_p=False)
        self.num_forwards += 1
        return tokens.tolist()  # (a host sync a draft step: the next step's input)


def load_draft(path: str, quantization: str | None, target_vocab: int, target_tokenizer,
               dtype: torch.dtype, device: torch.device, block_size: int, kv_int8: bool,
               max_model_len: int):
    """(the draft's DecoderModel, its one-block KV spec): ValueError if it cannot draft for
    the target (another vocabulary or tokenizer: its tokens would mean something else)."""
    from tinyserve.engine.loading.checkpoint import load_weights
    from tinyserve.engine.loading.model_config import load_model_config
    from tinyserve.engine.model.kv_cache import KVCacheSpec
    from tinyserve.engine.model.rope import rope_tables
    from tinyserve.formats.gguf import is_gguf
    from tinyserve.text.tokenizer import Tokenizer

    mcfg = load_model_config(path)
    if mcfg.vocab_size != target_vocab:
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({mcfg.vocab_size}) "
                         f"is not the target's ({target_vocab})")
    if getattr(Tokenizer(path), "fingerprint", None) != getattr(target_tokenizer, "fingerprint",
                                                                 None):
        raise ValueError("speculative_config.model: the draft's tokenizer is not the target's")
    if is_gguf(path):  # llama.cpp's file: its codes kept in the group-wise kernels
        from tinyserve.engine.loading.gguf_weights import load_gguf_weights
        from tinyserve.formats.gguf import GGUFFile

        weights = load_gguf_weights(GGUFFile(path), mcfg, dtype, device, quantization, False)
    else:
        weights = load_weights(path, mcfg, dtype, device, quantization)
    if mcfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model: the draft's context "
                         f"({mcfg.max_position_embeddings}) is shorter than max_model_len "
                         f"({max_model_len})")
    model = DecoderModel(mcfg, weights, rope_tables(mcfg, max_model_len, device))
    one_block = KVCacheSpec(1, block_size, mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim,
                            dtype, kv_int8)
    return model, one_block
