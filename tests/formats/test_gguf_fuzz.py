"""A mutation fuzzer over small valid GGUF files (tests/gguf_writer.py's write_tiny: a Llama
with a scored SentencePiece vocabulary, a Qwen2 with a byte-level one and its merges, a Gemma 3
with per-layer windows): bit flips, random bytes, the header's integers set to boundary values,
truncations, duplicated and dropped chunks, each file from its own seed (file i: Random(i)).

Each mutated file goes the way the loaders take it: GGUFFile, gguf_raw_config, the ModelConfig
from those keys, and gguf_tokenizer (with an encode and a decode). It must load (and then every
special id lies in the vocabulary), or be refused with a GGUFError / ValueError /
ModelLoadError naming the file; in at most 5 s, in a child process whose peak RSS stays under
500 MB. TINYSERVE_GGUF_FUZZ sets the count (2000 here, ~6 s of CPU); the acceptance run:

    TINYSERVE_GGUF_FUZZ=10000 python -P -m pytest -s tests/formats/test_gguf_fuzz.py
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COUNT = int(os.environ.get("TINYSERVE_GGUF_FUZZ", "2000"))
SEEDS = [("llama", "sentencepiece"), ("qwen2", "gpt2"), ("gemma3", "sentencepiece")]
PER_FILE_S, PEAK_RSS_MB = 5.0, 500
REWRITES = 0.4  # the share of files whose metadata is rewritten (a valid header, odd values)
BOUNDARIES = [0, 1, 2, 0x7F, 0x80, 0xFF, 1 << 15, 0xFFFF, (1 << 31) - 1, 1 << 31, (1 << 32) - 1,
              (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def test_mutated_files_load_or_are_refused_by_name(tmp_path):
    import pytest

    pytest.importorskip("gguf")
    from tests.gguf_writer import write_tiny

    for arch, tokenizer in SEEDS:
        write_tiny(tmp_path / f"seed-{arch}.gguf", arch, tokenizer, layers=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
    start = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", "from tests.formats.test_gguf_fuzz import main; main()",
         str(tmp_path), str(COUNT)],
        capture_output=True, text=True, env=env, timeout=60 + COUNT * 0.1)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.splitlines()[-1])
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print("\nGGUF fuzz:", json.dumps({k: v for k, v in report.items() if k != "failures"}))
    assert not report["failures"], json.dumps(report["failures"][:5], indent=1)
    assert report["files"] == COUNT
    assert report["max_file_s"] <= PER_FILE_S, report["slowest"]
    assert report["peak_rss_mb"] < PEAK_RSS_MB


# ---- the child -------------------------------------------------------------------------------

def main() -> None:
    """argv: the folder of seed files, the count; prints one JSON line (the report)."""
    folder, count = Path(sys.argv[1]), int(sys.argv[2])
    import tinyserve.engine.loading.model_config  # noqa: F401  (imports outside the timings)
    import tinyserve.text.gguf_tokenizer  # noqa: F401
    limit = _vm_bytes() + (2 << 30)  # a regression fails with MemoryError, not a swapping host
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    seeds = [(p, p.read_bytes()) for p in sorted(folder.glob("seed-*.gguf"))]
    layouts = {p: _layout(data) for p, data in seeds}
    outcomes, failures, slowest, refusals = Counter(), [], (0.0, -1), Counter()
    signal.signal(signal.SIGALRM, _too_slow)
    cpu = time.process_time()
    for i in range(count):
        rng = random.Random(i)
        seed, data = seeds[i % len(seeds)]
        path = folder / f"mutant-{i:05d}.gguf"
        fields, entries = layouts[seed]
        mutant = _rewrite(rng, data, seed.stem.split("-")[1], entries) \
            if rng.random() < REWRITES else data
        path.write_bytes(_mutate(rng, mutant, fields) if mutant is data or rng.random() < 0.3
                         else mutant)
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, PER_FILE_S * 2)
        try:
            outcome = _load(path, refusals)
        except Exception as e:  # (the loaders' own refusals are caught in _load)
            outcome = f"FAIL {type(e).__name__}"
            failures.append({"file": i, "seed": seed.name, "error": _describe(e)})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = time.perf_counter() - t0
        slowest = max(slowest, (seconds, i))
        outcomes[outcome] += 1
        path.unlink()
    print(json.dumps({
        "files": count, "outcomes": dict(outcomes.most_common()), "failures": failures[:20],
        "refusals": dict(refusals.most_common(12)),
        "max_file_s": round(slowest[0], 3), "slowest": slowest[1],
        "cpu_s": round(time.process_time() - cpu, 1), "peak_rss_mb": _peak_rss_mb()}))


class _TooSlow(Exception):
    pass


def _too_slow(*_: object) -> None:
    raise _TooSlow(f"over {PER_FILE_S * 2} s")


def _load(path: Path, refusals: Counter) -> str:
    """What a loader does with the file; the outcome's name ("loaded", "refused by ...")."""
    from tinyserve.engine.loading.gguf_config import gguf_raw_config
    from tinyserve.engine.loading.model_config import ModelLoadError, model_config_from
    from tinyserve.formats.gguf import GGUFError, GGUFFile
    from tinyserve.text.gguf_tokenizer import gguf_tokenizer

    refused_as = (GGUFError, ValueError, ModelLoadError)
    stage = "GGUFFile"
    try:
        f = GGUFFile(path)
        stage = "gguf_raw_config"
        raw, gen = gguf_raw_config(f)
        stage = "ModelConfig"
        cfg = model_config_from(raw, gen, path)
        ids = [*cfg.eos_token_ids, *([cfg.bos_token_id] if cfg.bos_token_id is not None else [])]
        assert all(0 <= i < cfg.vocab_size for i in ids), (ids, cfg.vocab_size)
        config = "loaded"
    except refused_as as e:
        refusals[_named(e, path)] += 1
        config = f"refused by {stage}"
        if stage == "GGUFFile":  # (the tokenizer reads the same header)
            return config
    try:
        tok, _ = gguf_tokenizer(path)
        tok.decode(tok.encode("Hello world, the <s> <|im_end|> ünï 日本").ids)
        tokenizer = "loaded"
    except refused_as as e:
        refusals[_named(e, path)] += 1
        tokenizer = "refused"
    return f"config {config}, tokenizer {tokenizer}"


def _named(e: Exception, path: Path) -> str:
    """The refusal's reason, its numbers dropped (to count the kinds); it must name the file."""
    if str(path) not in str(e):
        raise AssertionError(f"a refusal that does not name the file: {type(e).__name__}: {e}")
    reason = str(e).replace(str(path), "FILE")
    return re.sub(r"\d+", "N", reason.split(":", 2)[-1] if "#" in reason else reason)[:90]


def _describe(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {str(e)[:300]} (at {Path(tb.filename).name}:{tb.lineno})"


def _vm_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmSize:")[1].split()[0]) * 1024


def _peak_rss_mb() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) // 1024


# ---- mutations -------------------------------------------------------------------------------

def _mutate(rng: random.Random, data: bytes, fields: dict[str, list[tuple[int, int]]]) -> bytes:
    """1 to 3 mutations, most inside the header (the tensor data past it is bytes anyone may
    hold)."""
    out = bytearray(data)
    header = max(off + size for kind in fields.values() for off, size in kind)
    for _ in range(rng.choice((1, 1, 1, 2, 2, 3))):
        end = header if rng.random() < 0.9 else len(out)
        at = rng.randrange(max(1, min(end, len(out))))
        how = rng.choice(("flip", "flip", "bytes", "field", "field", "field", "field", "cut",
                          "duplicate", "drop"))
        if how == "flip":
            out[at] ^= 1 << rng.randrange(8)
        elif how == "bytes":
            out[at:at + rng.randint(1, 8)] = rng.randbytes(rng.randint(1, 8))
        elif how == "field":
            _set_field(rng, out, fields)
        elif how == "cut":
            del out[at:]
        elif how == "duplicate":
            chunk = out[at:at + rng.choice((1, 4, 8, 12, rng.randint(1, 256)))]
            where = rng.choice((at, rng.randrange(len(out) + 1)))
            out[where:where] = chunk
        else:
            del out[at:at + rng.randint(1, 64)]
    return bytes(out)


def _set_field(rng: random.Random, out: bytearray,
               fields: dict[str, list[tuple[int, int]]]) -> None:
    """One of the header's integers to a boundary value (or next to its own)."""
    kind = rng.choices(("struct", "scalar", "item"), weights=(0.55, 0.35, 0.10))[0]
    if not fields[kind]:
        return
    off, size = rng.choice(fields[kind])
    if off + size > len(out):
        return
    mask = (1 << (8 * size)) - 1
    old = int.from_bytes(out[off:off + size], "little")
    value = rng.choice(BOUNDARIES) if rng.random() < 0.8 else old + rng.choice((-1, 1))
    out[off:off + size] = (value & mask).to_bytes(size, "little")


def _layout(data: bytes) -> tuple[dict[str, list[tuple[int, int]]], list[tuple[int, int, int]]]:
    """A valid file's header: (offset, size) of every integer in it, by kind ("struct":
    counts, lengths, value types, dims, tensor types and offsets; "scalar": a key's value;
    "item": an array's), and each metadata entry's (start, value type's offset, end)."""
    out: dict[str, list[tuple[int, int]]] = {"struct": [], "scalar": [], "item": []}
    entries = []
    pos = 4

    def field(size: int, kind: str = "struct") -> int:
        nonlocal pos
        out[kind].append((pos, size))
        pos += size
        return int.from_bytes(data[pos - size:pos], "little")

    def value(vtype: int, kind: str) -> None:
        nonlocal pos
        if vtype == 8:
            n = field(8)  # (not ``pos += field(8)``: that adds to the pos before the field)
            pos += n
        elif vtype == 9:
            item, count = field(4), field(8)
            for _ in range(count):
                value(item, "item")
        else:
            field(_SIZES[vtype], kind)

    field(4)
    n_tensors, n_kv = field(8), field(8)
    for _ in range(n_kv):
        start, n = pos, field(8)
        pos += n
        typed = pos
        value(field(4), "scalar")
        entries.append((start, typed, pos))
    for _ in range(n_tensors):
        n = field(8)
        pos += n
        for _ in range(field(4)):
            field(8)
        field(4), field(8)
    return out, entries


# ---- values of any type, for any key (the metadata's consumers meet what a file holds) ------

KEYS = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
        "attention.head_count_kv", "attention.key_length", "context_length", "rope.freq_base",
        "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
        "rope.scaling.original_context_length", "rope.scaling.attn_factor",
        "attention.sliding_window", "attention.sliding_window_pattern",
        "attn_logit_softcapping", "final_logit_softcapping",
        "attention.layer_norm_rms_epsilon", "expert_count", "vocab_size"]
GLOBAL_KEYS = ["general.alignment", "general.architecture", "tokenizer.ggml.model",
               "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.scores",
               "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
               "tokenizer.ggml.add_bos_token", "tokenizer.chat_template",
               *(f"tokenizer.ggml.{n}_token_id"
                 for n in ("bos", "eos", "eot", "eom", "padding", "unknown"))]
_FLOATS = [0.0, -1.0, 0.5, 1e-30, 1e30, float("nan"), float("inf"), float("-inf")]
_STRINGS = [b"", b"yarn", b"linear", b"llama", b"gpt2", b"llama-bpe", b"qwen2", b"gemma3",
            b"a b", b"\xff\xfe", b"x" * 300, "▁a".encode()]
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _value(rng: random.Random, vtype: int, depth: int = 0) -> bytes:
    """A value of ``vtype`` (9: an array of a random type, 0 to 4 items) as the file holds it."""
    if vtype in _INTS:
        size = struct.calcsize(_INTS[vtype])
        return (rng.choice(BOUNDARIES + [3, 4, 6, 32]) & ((1 << 8 * size) - 1)).to_bytes(
            size, "little")
    if vtype in (6, 12):
        return struct.pack("<f" if vtype == 6 else "<d", rng.choice(_FLOATS))
    if vtype == 7:
        return bytes([rng.choice((0, 1, 2))])
    if vtype == 8:
        text = rng.choice(_STRINGS)
        return struct.pack("<Q", len(text)) + text
    item = rng.choice([0, 4, 5, 6, 7, 8, 10] + ([9] if depth < 2 else []))
    count = rng.choice((0, 1, 2, 4))
    return struct.pack("<IQ", item, count) + b"".join(
        _value(rng, item, depth + 1) for _ in range(count))


def _entry(rng: random.Random, arch: str, key: str | None = None) -> bytes:
    key = key or rng.choice([f"{arch}.{k}" for k in KEYS] + GLOBAL_KEYS)
    vtype = rng.choice([0, 2, 4, 5, 6, 7, 8, 9, 9, 10, 11, 12])
    name = key.encode()
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", vtype) + _value(rng, vtype)


def _rewrite(rng: random.Random, data: bytes, arch: str,
             entries: list[tuple[int, int, int]]) -> bytes:
    """One metadata entry given a value of another type, dropped, or a key of the loaders'
    added (the header's key count kept true)."""
    out, n_kv = bytearray(data), len(entries)
    start, typed, end = rng.choice(entries)
    how = rng.choice(("retype", "retype", "drop", "add"))
    if how == "retype":
        key = bytes(out[start + 8:typed]).decode()
        out[start:end] = _entry(rng, arch, key)
    elif how == "drop":
        del out[start:end]
        n_kv -= 1
    else:
        out[end:end] = _entry(rng, arch)
        n_kv += 1
    out[16:24] = struct.pack("<Q", n_kv)
    return bytes(out)
