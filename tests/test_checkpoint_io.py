"""HF folder loading and saving: round trips, bf16, shards, tied heads, and every bad input."""
import json
import os
import shutil
import struct

import mindspore as ms
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import fixture_path, reference
from mindqwen import CheckpointError, ConfigError, QwenConfig, from_pretrained
from mindqwen.io.safetensors import SafetensorsFile, fp32_to_bf16_bits

QWEN2 = fixture_path("qwen2_tiny", "base")
QWEN3 = fixture_path("qwen3_tiny", "base")


def _params(model):
    return {p.name: p.asnumpy() for p in model.get_parameters()}


def _copy_base(src, dst, tensors=None, config_updates=None):
    """An HF folder like ``src`` with its tensors replaced by ``tensors`` (written by the
    safetensors library, independently of mindqwen's writer)."""
    os.makedirs(dst, exist_ok=True)
    config = json.load(open(os.path.join(src, "config.json")))
    config.update(config_updates or {})
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    if tensors is None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


@pytest.mark.parametrize("src", [QWEN2, QWEN3])
def test_save_then_load_is_bit_exact(src, tmp_path):
    model = from_pretrained(src)
    model.save_pretrained(str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    # The saved file holds exactly the HF tensors (read by the safetensors library).
    saved, original = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(
        os.path.join(src, "model.safetensors"))
    assert saved.keys() == original.keys()
    for k in original:
        assert np.array_equal(saved[k], original[k]), k
    again = from_pretrained(str(tmp_path / "out"))
    a, b = _params(model), _params(again)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert QwenConfig.from_hf(str(tmp_path / "out")) == model.config


def test_sharded_save_and_load(tmp_path):
    model = from_pretrained(QWEN3)
    model.save_pretrained(str(tmp_path / "out"), max_shard_size="200KB")
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "out" / "model.safetensors").exists()
    assert all(os.path.getsize(tmp_path / "out" / s) < 300_000 for s in shards)
    again = from_pretrained(str(tmp_path / "out"))
    a, b = _params(model), _params(again)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # Saving again unsharded replaces the shards: no stale layout shadows the new one.
    again.save_pretrained(str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]


def test_hf_sharded_checkpoint_loads(tmp_path):
    """Shards and index written as HF does (safetensors library, no mindqwen code)."""
    tensors = load_file(os.path.join(QWEN2, "model.safetensors"))
    keys = sorted(tensors)
    dst = tmp_path / "hf"
    _copy_base(QWEN2, str(dst), {k: tensors[k] for k in keys[:5]})
    os.rename(dst / "model.safetensors", dst / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in keys[5:]}, str(dst / "model-00002-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 if i < 5 else 2}-of-00002.safetensors" for i, k in enumerate(keys)}
    json.dump({"metadata": {}, "weight_map": weight_map}, open(dst / "model.safetensors.index.json", "w"))
    ref = reference("qwen2_tiny")
    logits = from_pretrained(str(dst))(ms.Tensor(ref["input_ids"].astype(np.int32))).asnumpy()
    assert np.abs(logits - ref["logits"]).max() <= 5e-5


def _write_bf16(path, tensors_bits):
    """A bf16 safetensors file with a hand-built header (raw uint16 bits)."""
    header, offset, blobs = {}, 0, []
    for k, bits in tensors_bits.items():
        header[k] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [offset, offset + bits.nbytes]}
        offset += bits.nbytes
        blobs.append(bits.tobytes())
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_bf16_checkpoint_loads_to_exact_fp32(tmp_path):
    tensors = load_file(os.path.join(QWEN2, "model.safetensors"))
    bits = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}  # truncate
    dst = _copy_base(QWEN2, str(tmp_path / "bf16"), tensors)
    _write_bf16(os.path.join(dst, "model.safetensors"), bits)
    model = from_pretrained(dst)
    for name, value in _params(model).items():
        expected = (bits[name].astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(value, expected), name


def test_fp16_checkpoint_loads_as_float16_and_float32(tmp_path):
    tensors = {k: v.astype(np.float16) for k, v in load_file(os.path.join(QWEN2, "model.safetensors")).items()}
    dst = _copy_base(QWEN2, str(tmp_path / "fp16"), tensors)
    m32, m16 = from_pretrained(dst), from_pretrained(dst, dtype="float16")
    for name, value in _params(m32).items():
        assert np.array_equal(value, tensors[name].astype(np.float32)), name
    assert all(p.dtype == ms.float16 for p in m16.get_parameters())


def test_bf16_save_rounds_to_nearest_even(tmp_path):
    x = np.array([1.0, 1.00390625, 1.01171875, 1.0 + 2**-9, -3.14159, 65504.0, np.inf, 1e-40], np.float32)
    # Independent: MindSpore's own fp32 -> bf16 cast.
    expected = ms.Tensor(x).astype(ms.bfloat16).view(ms.uint16).asnumpy()
    ours = fp32_to_bf16_bits(x)
    assert np.array_equal(ours, expected)
    # Closed form for the ties: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 → even (1.0).
    assert ours[1] == 0x3F80 and ours[2] == 0x3F82
    model = from_pretrained(QWEN2)
    model.save_pretrained(str(tmp_path / "b"), dtype="bfloat16")
    f = SafetensorsFile(str(tmp_path / "b" / "model.safetensors"))
    w = model.model.embed_tokens.weight.asnumpy()
    assert f.dtype("model.embed_tokens.weight") == "BF16"
    assert np.array_equal(f.raw("model.embed_tokens.weight"), fp32_to_bf16_bits(w))


def test_tied_checkpoint_with_stored_head_and_stale_rotary_buffers_load(tmp_path):
    tensors = load_file(os.path.join(QWEN2, "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    dst = _copy_base(QWEN2, str(tmp_path / "t"), tensors)
    ref = reference("qwen2_tiny")
    logits = from_pretrained(dst)(ms.Tensor(ref["input_ids"].astype(np.int32))).asnumpy()
    assert np.abs(logits - ref["logits"]).max() <= 5e-5


# ---------------------------------------------------------------- bad input: one clear error each
def test_missing_folder():
    with pytest.raises(CheckpointError, match="no/such/folder: checkpoint folder not found"):
        from_pretrained("no/such/folder")


def test_missing_weights_file(tmp_path):
    os.makedirs(tmp_path / "m")
    shutil.copy(os.path.join(QWEN2, "config.json"), tmp_path / "m")
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors .*pytorch_model\.bin"):
        from_pretrained(str(tmp_path / "m"))


def test_missing_config(tmp_path):
    os.makedirs(tmp_path / "m")
    with pytest.raises(ConfigError, match=r"config\.json: config file not found"):
        from_pretrained(str(tmp_path / "m"))


@pytest.mark.parametrize("cut", [4, 100, 20000])
def test_truncated_file(tmp_path, cut):
    dst = _copy_base(QWEN2, str(tmp_path / "t"))
    path = os.path.join(dst, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:cut] if cut < 20000 else data[:-cut])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: (truncated|corrupt)"):
        from_pretrained(dst)


def test_corrupt_header(tmp_path):
    dst = _copy_base(QWEN2, str(tmp_path / "c"))
    path = os.path.join(dst, "model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[8:20] = b"#" * 12
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt safetensors header"):
        from_pretrained(dst)


def test_missing_and_unexpected_keys(tmp_path):
    tensors = load_file(os.path.join(QWEN2, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.7.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    dst = _copy_base(QWEN2, str(tmp_path / "k"), tensors)
    with pytest.raises(CheckpointError) as e:
        from_pretrained(dst)
    msg = str(e.value)
    assert "missing keys model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected keys model.layers.7.mlp.up_proj.weight" in msg
    assert msg.startswith(dst)


def test_untied_checkpoint_without_head_is_missing_a_key(tmp_path):
    tensors = load_file(os.path.join(QWEN3, "model.safetensors"))
    del tensors["lm_head.weight"]
    dst = _copy_base(QWEN3, str(tmp_path / "u"), tensors)
    with pytest.raises(CheckpointError, match="missing keys lm_head.weight"):
        from_pretrained(dst)


def test_wrong_shape(tmp_path):
    dst = _copy_base(QWEN2, str(tmp_path / "s"), config_updates={"intermediate_size": 96})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.down_proj\.weight "
                                              r"has shape \[64, 128\], the model expects \[64, 96\]"):
        from_pretrained(dst)


def test_unsupported_architecture(tmp_path):
    dst = _copy_base(QWEN2, str(tmp_path / "a"), config_updates={"architectures": ["LlamaForCausalLM"],
                                                                 "model_type": "llama"})
    with pytest.raises(ConfigError, match=r"config\.json: unsupported architecture \['LlamaForCausalLM'\]"):
        from_pretrained(dst)


@pytest.mark.parametrize("updates,match", [
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
    ({"num_attention_heads": 5}, "hidden_size=64 is not divisible by num_attention_heads=5"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope' is not supported"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "rope_scaling with rope_type=.linear. needs factor"),
    ({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0, "layer_types": None},
     "sliding_window is not a positive integer"),
])
def test_inconsistent_config_names_the_field(updates, match):
    hf = json.load(open(os.path.join(QWEN2, "config.json")))
    with pytest.raises(ConfigError, match=match):
        QwenConfig.from_hf({**hf, **updates})


def test_bf16_compute_on_cpu_is_refused_early():
    with pytest.raises(ValueError, match="bfloat16.*CPU"):
        from_pretrained(QWEN2, dtype="bfloat16")


def test_presets_build_consistent_configs():
    from mindqwen.presets import PRESETS
    for name in PRESETS:
        config = QwenConfig.from_preset(name)
        assert config.num_attention_heads % config.num_key_value_heads == 0
    assert QwenConfig.from_preset("qwen3-0.6b").head_dim * 16 == 2048  # != hidden_size 1024
    with pytest.raises(ConfigError, match="unknown preset 'qwen9'"):
        QwenConfig.from_preset("qwen9")


def test_saved_folder_loads_in_transformers(tmp_path):
    """Only where torch + transformers are installed (not a project dependency)."""
    torch = pytest.importorskip("torch", reason="torch not installed: HF load check skipped")
    transformers = pytest.importorskip("transformers")
    model = from_pretrained(QWEN3)
    model.save_pretrained(str(tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    ref = reference("qwen3_tiny")
    with torch.no_grad():
        logits = hf(torch.tensor(ref["input_ids"])).logits.numpy()
    assert np.abs(logits - ref["logits"]).max() <= 1e-5
