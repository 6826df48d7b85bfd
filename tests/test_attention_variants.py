"""Padding, sliding window and rope scaling against HF transformers (fixtures/hf_extra.npz,
written by fixtures/make_hf_extra.py)."""
import json

import mindspore as ms
import numpy as np
import pytest

from conftest import fixture_path
from mindqwen import QwenConfig, QwenForCausalLM, from_pretrained
from mindqwen.io.hf import load_weights
from mindqwen.models.qwen import RotaryEmbedding

EXTRA = np.load(fixture_path("hf_extra.npz"))
TOL = 5e-5


def test_left_padding_equals_unpadded_rows(mode):
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    ids = EXTRA["pad/input_ids"].astype(np.int32)
    mask = EXTRA["pad/attention_mask"].astype(np.int32)
    padded = model(ms.Tensor(ids), ms.Tensor(mask)).asnumpy()
    n_pad = int((mask[1] == 0).sum())
    alone = model(ms.Tensor(ids[1:, n_pad:])).asnumpy()
    err_self = np.abs(padded[1, n_pad:] - alone[0]).max()
    err_hf = np.abs(padded[mask == 1] - EXTRA["pad/logits"][mask == 1]).max()
    print(f"left padding [{mode}]: vs unpadded row {err_self:.2e}, vs HF {err_hf:.2e}")
    assert err_self <= 1e-5
    assert err_hf <= TOL
    assert np.isfinite(padded).all()


def test_right_padding_leaves_real_tokens_unchanged():
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    ids = EXTRA["pad/input_ids"][:1, :10].astype(np.int32)
    padded_ids = np.concatenate([ids, np.zeros((1, 6), np.int32)], 1)
    mask = (np.arange(16) < 10).astype(np.int32)[None]
    a = model(ms.Tensor(padded_ids), ms.Tensor(mask)).asnumpy()[0, :10]
    b = model(ms.Tensor(ids)).asnumpy()[0]
    assert np.abs(a - b).max() <= 1e-5


def test_sliding_window_matches_hf(mode):
    overrides = json.loads(str(EXTRA["sliding/config_json"]))
    hf = json.load(open(fixture_path("qwen2_tiny", "base", "config.json")))
    hf.pop("layer_types")  # recomputed from use_sliding_window / max_window_layers
    config = QwenConfig.from_hf({**hf, **overrides})
    assert config.layer_types == json.loads(str(EXTRA["sliding/layer_types"]))
    model = QwenForCausalLM(config)
    load_weights(model, fixture_path("qwen2_tiny", "base"))
    logits = model(ms.Tensor(EXTRA["sliding/input_ids"].astype(np.int32))).asnumpy()
    err = np.abs(logits - EXTRA["sliding/logits"]).max()
    print(f"sliding window [{mode}] max-abs error vs HF: {err:.2e}")
    assert err <= TOL
    assert np.abs(logits - EXTRA["sliding/logits_full"]).max() > 1.0  # the window did act


def _rope_config(name: str) -> QwenConfig:
    rope = json.loads(str(EXTRA[f"rope/{name}/config_json"]))
    return QwenConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128,
                               "num_attention_heads": 4, "num_key_value_heads": 4,
                               "intermediate_size": 256, "num_hidden_layers": 1, "vocab_size": 64,
                               "max_position_embeddings": 256, "rope_parameters": rope})


@pytest.mark.parametrize("name", ["default", "linear", "yarn", "yarn_orig64", "dynamic"])
def test_rope_frequencies_match_hf(name):
    inv_freq, scaling = _rope_config(name).rope_inv_freq()
    np.testing.assert_allclose(inv_freq, EXTRA[f"rope/{name}/inv_freq"], rtol=1e-6)
    assert scaling == pytest.approx(float(EXTRA[f"rope/{name}/attention_scaling"]), rel=1e-7)


@pytest.mark.parametrize("name,length", [("yarn", 300), ("yarn_orig64", 300), ("dynamic", 100),
                                         ("dynamic", 400)])
def test_rope_tables_match_hf(name, length, mode):
    rotary = RotaryEmbedding(_rope_config(name))  # computed per call, for any position
    cos, sin = rotary(ms.Tensor(np.arange(length, dtype=np.int32)[None]))
    # HF's own fp32 angles are ~1e-5 off float64 near position 400 (dynamic is computed in-graph).
    tol = 2e-5 if name == "dynamic" else 1e-6
    np.testing.assert_allclose(cos.asnumpy()[:, 0], EXTRA[f"rope/{name}/cos_{length}"], atol=tol)
    np.testing.assert_allclose(sin.asnumpy()[:, 0], EXTRA[f"rope/{name}/sin_{length}"], atol=tol)


def test_packed_samples_equal_each_sample_alone(mode):
    """Three samples packed in one row with their positions (0 where each starts): each sample's
    logits equal the model run on that sample alone (positions restart, no attention across
    samples); without the positions the second sample differs. Padding after them, as a sample
    of its own or masked out, changes nothing."""
    model = from_pretrained(fixture_path("qwen3_tiny", "base"))
    rng = np.random.default_rng(0)
    samples = [rng.integers(10, 500, n).astype(np.int32) for n in (6, 7, 2)]
    row = np.concatenate(samples)[None]
    positions = np.concatenate([np.arange(len(d)) for d in samples])[None].astype(np.int32)
    alone = [model(ms.Tensor(d[None])).asnumpy()[0] for d in samples]
    plain = model(ms.Tensor(row)).asnumpy()[0]
    packed = model(ms.Tensor(row), None, None, ms.Tensor(positions)).asnumpy()[0]
    ends = np.cumsum([len(d) for d in samples])
    for d, logits, end in zip(samples, alone, ends):
        np.testing.assert_allclose(packed[end - len(d):end], logits, atol=2e-5)
    assert np.abs(plain[ends[0]:ends[1]] - alone[1]).max() > 1e-2  # the boundary matters
    n = row.shape[1]
    padded_row = ms.Tensor(np.concatenate([row, [[0, 0, 0]]], 1).astype(np.int32))
    as_sample = ms.Tensor(np.concatenate([positions, [[0, 1, 2]]], 1).astype(np.int32))  # the packer's padding
    masked = ms.Tensor((np.arange(n + 3) < n).astype(np.int32)[None])
    for mask in (None, masked):
        padded = model(padded_row, mask, None, as_sample).asnumpy()[0]
        np.testing.assert_allclose(padded[:n], packed, atol=2e-5)
