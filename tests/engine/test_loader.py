"""Loading: config variants and the errors an operator sees for a bad model directory."""

import json

import pytest
import torch

from tinyserve.config import EngineConfig
from tinyserve.engine.loading.checkpoint import load_weights
from tinyserve.engine.loading.demo import DEMO_CONFIG, write_random_llama, write_tokenizer
from tinyserve.engine.loading.model_config import ModelLoadError, load_model_config
from tinyserve.engine.loading.quantize import quantize_int8
from tinyserve.engine.model.rope import inv_freq


def rope_inv_freq(cfg):
    return inv_freq(cfg.rope_theta, cfg.rope_scaling, cfg.head_dim, cfg.max_position_embeddings)[0]


@pytest.fixture
def model_dir(tmp_path):
    write_random_llama(tmp_path, DEMO_CONFIG)
    write_tokenizer(tmp_path)
    return tmp_path


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        load_model_config(tmp_path)


def test_unsupported_architecture(model_dir):
    edit_config(model_dir, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        load_model_config(model_dir)


def test_shape_mismatch_names_the_tensor_and_file(model_dir):
    edit_config(model_dir, intermediate_size=161)
    cfg = load_model_config(model_dir)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: tensor 'model.layers.0.mlp"):
        load_weights(model_dir, cfg, torch.float32, "cpu")


def test_missing_weights_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    cfg = load_model_config(model_dir)
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_weights(model_dir, cfg, torch.float32, "cpu")


def test_sharded_checkpoint_loads(model_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(model_dir / fname))
    (model_dir / "model.safetensors").unlink()
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = load_model_config(model_dir)
    w = load_weights(model_dir, cfg, torch.float32, "cpu")
    assert torch.equal(w.embed, tensors["model.embed_tokens.weight"])


def test_classic_and_transformers5_rope_keys_agree(model_dir):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    edit_config(model_dir, rope_theta=500000.0, rope_scaling=scaling)
    classic = load_model_config(model_dir)
    edit_config(model_dir, rope_scaling=None, rope_theta=None,
                rope_parameters={**scaling, "rope_theta": 500000.0})
    modern = load_model_config(model_dir)
    assert classic.rope_theta == modern.rope_theta == 500000.0
    assert torch.equal(rope_inv_freq(classic), rope_inv_freq(modern))
    assert not torch.equal(rope_inv_freq(classic), rope_inv_freq(
        load_model_config_unscaled(model_dir)))


def load_model_config_unscaled(model_dir):
    edit_config(model_dir, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return load_model_config(model_dir)


def test_unsupported_rope_type(model_dir):
    edit_config(model_dir, rope_scaling={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="mrope"):
        load_model_config(model_dir)


def test_int8_quantization_round_trip():
    w = torch.randn(37, 53)
    q = quantize_int8(w)
    assert q.weight.dtype == torch.int8 and q.scale.shape == (37,)
    assert q.weight.abs().max() <= 127
    err = (q.weight.float() * q.scale[:, None] - w).abs().max(dim=1).values
    assert torch.all(err <= q.scale / 2 + 1e-7)  # at most half a step per channel


def test_int8_weight_bytes_shrink(model_dir):
    cfg = load_model_config(model_dir)
    w = load_weights(model_dir, cfg, torch.float32, "cpu", quantization="int8")
    assert w.layers[0].qkv.weight.dtype == torch.int8
    assert w.lm_head.weight.dtype == torch.float32  # lm_head and embedding stay float
    assert w.nbytes() < 0.5 * w.nbytes(torch.float32)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=12)
    with pytest.raises(ValueError, match="exclusive"):
        EngineConfig(num_kv_blocks=4, kv_cache_memory=1 << 20)


def test_bfloat16_is_refused_on_cpu(model_dir):
    from tinyserve.engine.device_engine import DeviceEngine

    if torch.cuda.is_available():
        pytest.skip("bf16 is allowed on a GPU")
    with pytest.raises(ValueError, match="bfloat16"):
        DeviceEngine(EngineConfig(model=str(model_dir), dtype="bfloat16"))
