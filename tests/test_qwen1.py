"""The original Qwen (Qwen-1.8B/7B/14B/72B, ``QWenLMHeadModel``): a tiny checkpoint in that layout,
built here, against a numpy forward written from the published ``modeling_qwen.py`` math
(fused c_attn with bias, ``a1 * silu(a2)`` with a1 = w1(x), a2 = w2(x), logn attention scaling
and dynamic NTK rotary at inference beyond ``seq_length``); the layout round trip; LoRA with the
fine-tuning guides' ``target_modules=["query_key_value"]``."""
import json
import math
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors.numpy import load_file, save_file

from mindqwen import LoraConfig, QwenConfig, QwenForCausalLM, apply_lora, from_pretrained

V, H, L, N, D, FF = 96, 32, 2, 4, 8, 48  # vocab, hidden, layers, heads, head dim, w1/w2 width
SEQ_LENGTH = 8  # the training length: logn and NTK act beyond it
CONFIG = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "vocab_size": V, "hidden_size": H,
          "num_hidden_layers": L, "num_attention_heads": N, "kv_channels": D, "intermediate_size": 2 * FF,
          "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0, "seq_length": SEQ_LENGTH,
          "max_position_embeddings": 64, "use_logn_attn": True, "use_dynamic_ntk": True, "no_bias": True,
          "tie_word_embeddings": False, "scale_attn_weights": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random checkpoint in the original layout (weights drawn so none is trivially 0 or 1)."""
    rng = np.random.default_rng(0)
    w = {"transformer.wte.weight": rng.normal(0, 0.3, (V, H)), "transformer.ln_f.weight": rng.uniform(0.5, 1.5, H),
         "lm_head.weight": rng.normal(0, 0.3, (V, H))}
    for i in range(L):
        p = f"transformer.h.{i}."
        w.update({p + "ln_1.weight": rng.uniform(0.5, 1.5, H), p + "ln_2.weight": rng.uniform(0.5, 1.5, H),
                  p + "attn.c_attn.weight": rng.normal(0, 0.15, (3 * N * D, H)),
                  p + "attn.c_attn.bias": rng.normal(0, 0.1, 3 * N * D),
                  p + "attn.c_proj.weight": rng.normal(0, 0.15, (H, N * D)),
                  p + "mlp.w1.weight": rng.normal(0, 0.15, (FF, H)), p + "mlp.w2.weight": rng.normal(0, 0.15, (FF, H)),
                  p + "mlp.c_proj.weight": rng.normal(0, 0.15, (H, FF))})
    path = tmp_path_factory.mktemp("qwen1")
    save_file({k: v.astype(np.float32) for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    return str(path)


def reference_logits(w, ids, training=False):
    """modeling_qwen.py's forward in float64 numpy, one row: ids (S,) → logits (S, V)."""
    s = len(ids)

    def rms(x, g):
        return g * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)

    # RotaryEmbedding.update_rotary_pos_emb with QWenModel.get_ntk_alpha(kv_seq_len)
    ntk_alpha = 1.0
    if not training:
        context_value = math.log(s / SEQ_LENGTH, 2) + 1
        ntk_alpha = max(2 ** math.ceil(context_value) - 1, 1)
    base = 10000 * ntk_alpha ** (D / (D - 2))
    inv_freq = 1.0 / base ** (np.arange(0, D, 2) / D)
    emb = np.concatenate([np.outer(np.arange(s), inv_freq)] * 2, -1)  # (S, D)
    cos, sin = np.cos(emb)[:, None], np.sin(emb)[:, None]  # (S, 1, D)

    def rotate(t):  # _rotate_half: the two halves of the last axis
        return np.concatenate([-t[..., D // 2:], t[..., :D // 2]], -1)

    logn = np.array([math.log(i, SEQ_LENGTH) if i > SEQ_LENGTH else 1 for i in range(1, s + 1)])[:, None, None]
    x = w["transformer.wte.weight"][ids]
    for i in range(L):
        p = f"transformer.h.{i}."
        h = rms(x, w[p + "ln_1.weight"])
        qkv = h @ w[p + "attn.c_attn.weight"].T + w[p + "attn.c_attn.bias"]
        q, k, v = (t.reshape(s, N, D) for t in np.split(qkv, 3, -1))
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        if not training:
            q = q * logn
        scores = np.einsum("qnd,knd->nqk", q, k) / math.sqrt(D)
        scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        x = x + np.einsum("nqk,knd->qnd", probs, v).reshape(s, N * D) @ w[p + "attn.c_proj.weight"].T
        h = rms(x, w[p + "ln_2.weight"])
        a1, a2 = h @ w[p + "mlp.w1.weight"].T, h @ w[p + "mlp.w2.weight"].T
        x = x + (a1 * a2 / (1 + np.exp(-a2))) @ w[p + "mlp.c_proj.weight"].T
    return rms(x, w["transformer.ln_f.weight"]) @ w["lm_head.weight"].T


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
