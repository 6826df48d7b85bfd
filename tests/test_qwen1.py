"""The original Qwen (Qwen-1.8B/7B/14B/72B, ``QWenLMHeadModel``): a tiny checkpoint in that layout,
built here, against a numpy forward written from the published ``modeling_qwen.py`` math
(fused c_attn with bias, ``a1 * silu(a2)`` with a1 = w1(x), a2 = w2(x), logn attention scaling
and dynamic NTK rotary at inference beyond ``seq_length``); the layout round trip; LoRA with the
fine-tuning guides' ``target_modules=["query_key_value"]``."""
import json
import os
import sys

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file, save_file

from conftest import fixture_path
from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora, from_pretrained

sys.path.insert(0, fixture_path())
from qwen1_reference import CONFIG, FF, L, SEQ_LENGTH, V, draw_weights, reference_logits  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random checkpoint in the original layout (weights drawn so none is trivially 0 or 1)."""
    path = tmp_path_factory.mktemp("qwen1")
    save_file({k: v.astype(np.float32) for k, v in draw_weights().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


@pytest.mark.parametrize("length", [6, 20])  # within seq_length; beyond it (NTK alpha 3, logn > 1)
def test_logits_equal_the_numpy_forward_of_modeling_qwen(folder, length, mode):
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    ids = np.random.default_rng(length).integers(0, V, length)
    model = from_pretrained(folder)
    assert model.config.model_type == "qwen" and model.config.intermediate_size == FF
    err = np.abs(model(Tensor(ids[None].astype(np.int32))).asnumpy()[0] - reference_logits(w, ids)).max()
    print(f"original Qwen, {length} tokens [{mode}]: logits max-abs error vs numpy {err:.1e}")
    assert err <= 5e-5
    if length > SEQ_LENGTH:  # training sees neither logn nor NTK, as modeling_qwen.py
        model = from_pretrained(folder)
        model.set_train(True)  # before the first call: a compiled graph keeps the mode it was built in
        err = np.abs(model(Tensor(ids[None].astype(np.int32))).asnumpy()[0] - reference_logits(w, ids, True)).max()
        assert err <= 5e-5


def test_cached_generation_equals_the_full_forward_within_seq_length(folder):
    """Greedy decoding with the KV cache up to seq_length tokens: the numpy forward's argmax at
    every length. (Beyond seq_length, modeling_qwen.py holds the prefill's NTK base while
    decoding; mindqwen's cache takes it from the current length: docs/models.md.)"""
    from mindqwen import generate
    w = {k: v.astype(np.float64) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    prompt = np.random.default_rng(1).integers(0, V, 3).tolist()
    out = generate(from_pretrained(folder), [prompt], max_new_tokens=SEQ_LENGTH - 3)[0].tolist()
    seq = list(prompt)
    while len(seq) < SEQ_LENGTH:
        seq.append(int(np.argmax(reference_logits(w, np.array(seq))[-1])))
    assert out == seq


def test_layout_round_trip_is_bit_exact_and_the_config_is_the_original(folder, tmp_path):
    model = from_pretrained(folder)
    model.save_pretrained(str(tmp_path / "out"))
    original, saved = load_file(os.path.join(folder, "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert saved.keys() == original.keys() and all(np.array_equal(saved[k], original[k]) for k in original)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("architectures", "model_type", "kv_channels", "intermediate_size", "seq_length", "use_logn_attn",
                "use_dynamic_ntk", "rotary_emb_base", "no_bias", "layer_norm_epsilon"):
        assert config[key] == CONFIG[key], key
    assert QwenConfig.from_hf(config) == model.config


def test_the_guides_lora_config_trains(folder, tmp_path):
    """LoraConfig(r=8, lora_alpha=32, lora_dropout=0.1, target_modules=["query_key_value"]): the
    fused projection's name targets q, k and v; a few steps of fit lower the loss."""
    from mindqwen import TokenDataset, TrainerConfig, fit
    ms.set_seed(0)
    model = apply_lora(from_pretrained(folder), LoraConfig(r=8, lora_alpha=32, lora_dropout=0.1,
                                                           target_modules=["query_key_value"]))
    names = {p.name for p in model.trainable_params()}
    assert {f"model.layers.0.self_attn.{x}_proj.lora_a" for x in "qkv"} <= names and len(names) == 2 * 3 * L
    data = np.random.default_rng(0).integers(0, V, (8, 8))
    summary = fit(model, TokenDataset(data), TrainerConfig(max_steps=15, micro_batch_size=8, lr=1e-2, warmup_steps=0,
                                                           output_dir=str(tmp_path), progress=False))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    with pytest.raises(ValueError, match="query_key_value"):
        apply_lora(QwenForCausalLM(QwenConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1)),
                   LoraConfig(target_modules=["query_key_value"]))
