"""Hostile GGUF files, one test a problem the reader had (formats/gguf.py, and its consumers
engine/loading/gguf_config.py, model_config.py, text/gguf_tokenizer.py): each is refused with a
GGUFError (a ModelLoadError through load_model_config) naming the file, the key or tensor, and
the value, or loads within bounds. Whatever could take gigabytes or minutes runs in a child
under an address-space limit and a timeout, so a regression fails fast instead of eating the
machine."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from tests.gguf_writer import (  # noqa: E402
    V,
    array,
    gstr,
    kv,
    raw_file,
    tensor_info,
    tiny_metadata,
    write_tiny,
)
from tinyserve.engine.loading.gguf_config import gguf_raw_config  # noqa: E402
from tinyserve.engine.loading.model_config import ModelLoadError, load_model_config  # noqa: E402
from tinyserve.formats.gguf import GGUFError, GGUFFile  # noqa: E402
from tinyserve.text.gguf_tokenizer import gguf_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_CHILD = """
import json, resource, sys, time
from pathlib import Path
from tinyserve.engine.loading.model_config import load_model_config
from tinyserve.formats.gguf import GGUFFile
from tinyserve.text.gguf_tokenizer import gguf_tokenizer

def status(field):
    return int(Path("/proc/self/status").read_text().split(field + ":")[1].split()[0]) * 1024

path = Path(sys.argv[1])
limit = status("VmSize") + int(sys.argv[3]) * 2**20  # past what the imports took
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
start = time.perf_counter()
try:
    {call}(path)
    error = None
except BaseException as e:
    error = f"{{type(e).__name__}}: {{e}}"
print(json.dumps({{"error": error, "seconds": time.perf_counter() - start,
                  "peak_mb": status("VmHWM") / 2**20}}))
"""


def bounded(call: str, path: Path, memory_mb: int = 512, timeout: float = 60) -> dict:
    """``call`` (GGUFFile, load_model_config or gguf_tokenizer) of ``path`` in a child allowed
    ``memory_mb`` of address space past its imports and ``timeout`` seconds: its error (None:
    it loaded), seconds and peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1"}
    try:
        child = subprocess.run([sys.executable, "-c", _CHILD.format(call=call), str(path),
                                call, str(memory_mb)],
                               capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"still running after {timeout} s", "seconds": timeout, "peak_mb": 0}
    assert child.returncode == 0, child.stderr[-2000:]
    return json.loads(child.stdout.splitlines()[-1])


def refused(outcome: dict, kind: str, *names: str) -> None:
    """The child was refused by a ``kind`` error naming each of ``names``, quickly."""
    error = outcome["error"] or "loaded"
    assert error.startswith(f"{kind}: "), error[:500]
    for name in names:
        assert name in error, (name, error[:500])
    assert outcome["seconds"] < 10 and outcome["peak_mb"] < 300, outcome


# ---- memory and time bombs -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_a_block_count_past_the_files_layers_is_refused_before_any_per_layer_list(tmp_path,
                                                                                   arch):
    """Was: 2^40 layers built a list of 2^40 (5 GB in 39 s, then an empty error; phi3 a
    MemoryError). (Gemma 3 by its default period: a per-layer pattern is checked against the
    count.)"""
    meta = {f"{arch}.block_count": (2**40, V.UINT64), "gemma3.attention.sliding_window_pattern":
            None}
    path = write_tiny(tmp_path / "m.gguf", arch, meta=meta)
    refused(bounded("load_model_config", path), "ModelLoadError", str(path),
            f"{arch}.block_count", str(2**40))


def test_a_40_mb_metadata_array_is_refused_within_bounds(tmp_path):
    """Was: 20M u16 items as a Python list, 930 MB for a 40 MB file."""
    count = 20 << 20
    path = raw_file(tmp_path / "m.gguf", [kv("x.big", 9, array(2, count, b"\x01\x01" * count))])
    refused(bounded("GGUFFile", path), "GGUFError", str(path), "x.big", "MiB of metadata")


def test_a_quarter_million_keys_are_refused(tmp_path):
    """Was: every key read (3M keys: 431 MB)."""
    kvs = [kv(f"k{i}", 0, b"\x01") for i in range(250_000)]
    path = raw_file(tmp_path / "m.gguf", kvs)
    refused(bounded("GGUFFile", path), "GGUFError", str(path), "250000 metadata keys")


def test_merges_of_a_million_character_token_are_built_in_linear_time(tmp_path):
    """Was: every split of every token sliced (quadratic: over 100 s for 1M characters)."""
    meta = tiny_metadata("llama", "sentencepiece", 1)
    tokens = meta["tokenizer.ggml.tokens"][0] + ["▁" + "ab" * 500_000]
    path = write_tiny(tmp_path / "m.gguf", meta={
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.scores": ([-float(i) for i in range(len(tokens))], V.ARRAY),
        "tokenizer.ggml.token_type": ([1] * len(tokens), V.ARRAY, V.INT32)})
    outcome = bounded("gguf_tokenizer", path, timeout=30)
    assert outcome["error"] is None and outcome["seconds"] < 10, outcome


def test_a_vocabulary_whose_merges_take_too_long_is_refused_by_name(tmp_path):
    """Every length from 1 to 2000 of one letter: ~2.7e9 characters' slicing and 2M merges;
    refused past the work budget (MERGE_WORK) instead. (Was: 2M merges built, a MemoryError
    under the child's limit.)"""
    tokens = ["<unk>"] + ["a" * n for n in range(1, 2001)]
    path = write_tiny(tmp_path / "m.gguf", meta={
        "tokenizer.ggml.tokens": (tokens, V.ARRAY),
        "tokenizer.ggml.scores": ([-float(i) for i in range(len(tokens))], V.ARRAY),
        "tokenizer.ggml.token_type": ([1] * len(tokens), V.ARRAY, V.INT32),
        "tokenizer.ggml.eos_token_id": (0, V.UINT32), "tokenizer.ggml.bos_token_id": None,
        "tokenizer.ggml.unknown_token_id": None})
    refused(bounded("gguf_tokenizer", path, timeout=30), "GGUFError", str(path),
            "tokenizer.ggml.tokens", "units of work")


def test_arrays_nested_deep_are_refused_by_name(tmp_path):
    """Was: 100k arrays deep, a RecursionError naming nothing."""
    payload = struct.pack("<IQ", 9, 1) * 100_000 + struct.pack("<IQ", 0, 0)
    path = raw_file(tmp_path / "m.gguf", [kv("x.deep", 9, payload)])
    with pytest.raises(GGUFError, match="x.deep.*nested") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


# ---- values the consumers divided by, or fed to int() ----------------------------------------

@pytest.mark.parametrize("value,vtype", [(0, V.UINT32), (3, V.UINT32), (2**64 - 1, V.UINT64),
                                         ("32", V.STRING), (True, V.BOOL)])
def test_the_alignment_must_be_a_power_of_two(tmp_path, value, vtype):
    """Was: 0 a ZeroDivisionError, a string a bare ValueError, 3 accepted."""
    path = write_tiny(tmp_path / "m.gguf", meta={"general.alignment": (value, vtype)})
    with pytest.raises(GGUFError, match="general.alignment .*power of two") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("arch,key,value,vtype", [
    ("llama", "attention.head_count", 0, V.UINT32),  # was: ZeroDivisionError
    ("llama", "attention.head_count_kv", 0, V.UINT32),  # was: silently the head count
    ("llama", "attention.key_length", 0, V.UINT32),  # was: silently hidden / heads
    ("gemma3", "attention.sliding_window_pattern", 0, V.UINT32),  # was: ZeroDivisionError
    ("llama", "embedding_length", "eight", V.STRING),  # was: a bare ValueError from int()
    ("llama", "block_count", 1.5, V.FLOAT32),
    ("llama", "rope.freq_base", "x", V.STRING),
    ("llama", "attention.layer_norm_rms_epsilon", float("nan"), V.FLOAT32),
    ("llama", "context_length", [1, 2], V.ARRAY),
])
def test_a_value_out_of_kind_or_range_is_refused_by_name(tmp_path, arch, key, value, vtype):
    path = write_tiny(tmp_path / "m.gguf", arch, meta={f"{arch}.{key}": (value, vtype)})
    with pytest.raises(ModelLoadError) as e:
        load_model_config(path)
    assert str(path) in str(e.value) and f"{arch}.{key}" in str(e.value), str(e.value)


def test_yarn_without_its_factor_is_refused_by_name(tmp_path):
    """Was: float(None), a TypeError naming nothing."""
    path = write_tiny(tmp_path / "m.gguf", meta={"llama.rope.scaling.type": ("yarn", V.STRING)})
    with pytest.raises(GGUFError, match="llama.rope.scaling.factor is missing") as e:
        gguf_raw_config(GGUFFile(path))
    assert str(path) in str(e.value)


def test_strings_where_numbers_belong_in_the_tokenizer_are_refused_by_name(tmp_path):
    path = write_tiny(tmp_path / "m.gguf", meta={
        "tokenizer.ggml.scores": (["a"] * len(tiny_metadata("llama", "sentencepiece", 1)[
            "tokenizer.ggml.tokens"][0]), V.ARRAY)})
    with pytest.raises(GGUFError, match="tokenizer.ggml.scores is an array of .*expected an "
                                        "array of integers or numbers") as e:
        gguf_tokenizer(path)
    assert str(path) in str(e.value)


def test_a_gemma_vocabulary_without_unk_encodes(tmp_path):
    """Found by the fuzzer: was built with an unk token it lacks, so every encode that needed
    it raised (a bare Exception from tokenizers)."""
    meta = tiny_metadata("gemma3", "sentencepiece", 1)
    tokens = ["<nope>" if t == "<unk>" else t for t in meta["tokenizer.ggml.tokens"][0]]
    path = write_tiny(tmp_path / "m.gguf", "gemma3",
                      meta={"tokenizer.ggml.tokens": (tokens, V.ARRAY)})
    tok, _ = gguf_tokenizer(path)
    assert tok.decode(tok.encode("hello ünï 日本").ids).startswith("hello")


# ---- tensors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dims,match", [
    ([2**32, 2**32], "elements"),  # was: wrapped to 0 in int64, 0 bytes: past every check
    ([2**63, 2], "elements"),
    ([1, 1, 1, 1, 1], "5 dimensions"),  # was: accepted
    ([0, 4], "at least 1"),  # was: accepted (0 bytes)
])
def test_tensor_dims_are_bounded(tmp_path, dims, match):
    path = raw_file(tmp_path / "m.gguf", [kv("general.architecture", 8, gstr("llama"))],
                    [tensor_info("t.weight", dims)], data=bytes(64))
    with pytest.raises(GGUFError, match=match) as e:
        GGUFFile(path)
    assert str(path) in str(e.value) and "t.weight" in str(e.value)


def test_a_length_past_the_file_names_its_key(tmp_path):
    """Was: "truncated header", naming no key."""
    path = raw_file(tmp_path / "m.gguf", [kv("general.name", 8, struct.pack("<Q", 2**64 - 1))])
    with pytest.raises(GGUFError, match="'general.name': truncated") as e:
        GGUFFile(path)
    assert str(path) in str(e.value)


def test_a_key_twice_is_refused(tmp_path):
    """Was: the second silently won."""
    path = raw_file(tmp_path / "m.gguf", [kv("general.architecture", 8, gstr("llama")),
                                         kv("general.architecture", 8, gstr("gemma3"))])
    with pytest.raises(GGUFError, match="'general.architecture': appears twice"):
        GGUFFile(path)


def test_a_split_name_of_no_parts_is_refused(tmp_path):
    """Was: an IndexError."""
    path = write_tiny(tmp_path / "m-00001-of-00000.gguf")
    with pytest.raises(GGUFError, match="not a part of a split model"):
        GGUFFile(path)


# ---- special token ids -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bos", "eos", "eot", "eom", "padding", "unknown"])
@pytest.mark.parametrize("value,vtype", [(2**64 - 1, V.UINT64), (None, V.UINT32)])
def test_special_token_ids_outside_the_vocabulary_are_refused(tmp_path, name, value, vtype):
    """Was: an EOS of 2^64 - 1 loaded and served, then every min_tokens request failed its
    step (OverflowError); the tokenizer skipped such ids silently. (None: the vocabulary's
    size, one past its last id.)"""
    vocab = len(tiny_metadata("llama", "sentencepiece", 1)["tokenizer.ggml.tokens"][0])
    value = vocab if value is None else value
    key = f"tokenizer.ggml.{name}_token_id"
    path = write_tiny(tmp_path / "m.gguf", meta={key: (value, vtype)})
    for load, error in ((load_model_config, ModelLoadError), (gguf_tokenizer, GGUFError)):
        with pytest.raises(error) as e:
            load(path)
        assert all(s in str(e.value) for s in (str(path), key, str(value))), str(e.value)


def _hf_dir(path: Path, config: dict, generation: dict | None = None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, **config}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.mark.parametrize("config,generation,where,key,value", [
    ({"eos_token_id": 2**64 - 1}, None, "config.json", "eos_token_id", 2**64 - 1),
    ({"bos_token_id": 32}, None, "config.json", "bos_token_id", 32),
    ({"eos_token_id": [2, -1]}, None, "config.json", "eos_token_id", -1),
    ({"eos_token_id": 2}, {"eos_token_id": [2, 40]}, "generation_config.json", "eos_token_id",
     40),
])
def test_hf_token_ids_outside_the_vocabulary_are_refused(tmp_path, config, generation, where,
                                                         key, value):
    model = _hf_dir(tmp_path / "m", config, generation)
    with pytest.raises(ModelLoadError) as e:
        load_model_config(model)
    message = str(e.value)
    assert str(model / where) in message and key in message and str(value) in message, message
    assert load_model_config(_hf_dir(tmp_path / "ok", {"eos_token_id": [1, 31]})) \
        .eos_token_ids == (1, 31)
