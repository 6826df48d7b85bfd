"""Name maps and fused layouts: HF → mindformers (legacy, Mcore; fused or not) → HF is bit-exact on
the reference models, the model built from the converted-back weights gives HF's logits, and the
interleaved layout puts each KV group's q heads, k head and v head together."""
import mindspore as ms
import numpy as np
import pytest

from conftest import MODELS, fixture_path, reference
from mindqwen import QwenConfig, QwenForCausalLM
from mindqwen.io.hf import open_checkpoint
from mindqwen.io.convert import from_format, fuse, lazy, part_rows, to_format

VARIANTS = [("mindformers", None, None), ("mindformers", "interleaved", "interleaved"),
            ("mindformers-mcore", "contiguous", "contiguous"), ("mindformers-mcore", "interleaved", "interleaved"),
            ("mindformers-mcore", "interleaved", "contiguous")]


def hf_state(name):
    files = open_checkpoint(fixture_path(name, "base"))
    return {k: f.get(k) for k, f in files.items()}, QwenConfig.from_hf(fixture_path(name, "base"))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fmt,qkv,mlp", VARIANTS)
def test_round_trip_is_bit_exact_and_gives_hf_logits(name, fmt, qkv, mlp):
    state, cfg = hf_state(name)
    foreign = to_format(lazy(state), fmt, cfg.num_key_value_heads, qkv, mlp)
    assert not set(foreign) & {k for k in state if "layers" in k}  # every layer key was renamed
    rows = part_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    foreign = lazy({k: t.load() for k, t in foreign.items()})  # as a foreign checkpoint holds them
    back = {k: t.load() for k, t in from_format(foreign, fmt, cfg.num_key_value_heads, rows, qkv, mlp).items()}
    assert set(back) == set(state)
    for k in state:
        assert back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k]), k
    model = QwenForCausalLM(cfg)
    for p in model.get_parameters():
        p.set_data(ms.Tensor(back[p.name]))
    ref = reference(name)
    ids = ms.Tensor(ref["input_ids"].astype(np.int32))
    assert np.abs(model(ids).asnumpy() - ref["logits"]).max() <= 5e-5  # HF's, within test_model_parity's budget


def test_interleaved_qkv_groups_heads_by_kv_head():
    n, kv, d, h = 4, 2, 3, 5
    q, k, v = (np.arange(r * h).reshape(r, h) + off for r, off in ((n * d, 0), (kv * d, 1000), (kv * d, 2000)))
    fused = fuse([q, k, v], "qkv", kv, interleaved=True)
    per_group = (n // kv + 2) * d
    for g in range(kv):
        block = fused[g * per_group:(g + 1) * per_group]
        assert np.array_equal(block[:n // kv * d], q[g * n // kv * d:(g + 1) * n // kv * d])  # the group's q heads
        assert np.array_equal(block[n // kv * d:n // kv * d + d], k[g * d:(g + 1) * d])
        assert np.array_equal(block[-d:], v[g * d:(g + 1) * d])
    gate, up = np.arange(8).reshape(4, 2), np.arange(8).reshape(4, 2) + 100
    assert np.array_equal(fuse([gate, up], "mlp", kv, interleaved=True)[1::2], up)  # rows alternate gate, up


def test_unmatched_keys_and_unknown_formats_are_named():
    state, cfg = hf_state("qwen2_tiny")
    state["model.layers.0.self_attn.rotary.extra"] = np.zeros(1, np.float32)
    with pytest.raises(KeyError, match="match no name map entry: model.layers.0.self_attn.rotary.extra"):
        to_format(lazy(state), "mindformers", cfg.num_key_value_heads)
    with pytest.raises(ValueError, match="unknown checkpoint format 'megatron'"):
        to_format(lazy(state), "megatron", cfg.num_key_value_heads)
