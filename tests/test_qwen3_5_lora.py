"""LoRA on Qwen3.5 (hybrid Gated DeltaNet + gated attention) against PEFT 0.22 / transformers 5.25
(fixtures/qwen3_5/qwen3_5_lora, made by make_qwen3_5_lora_golden.py): ``target_modules="all-linear"`` adapts
the modules PEFT adapts (the five ``linear_attn`` projections included), PEFT's adapter folder gives PEFT's
logits over 80 tokens (two delta-rule chunks), and mindqwen's export is PEFT's file layout and reloads exactly.
GRAPH_MODE.

Errors are max|Δ| / max|ref|. The golden records how far each single module's adapter moves the logits
(``drop_one_effect``, at least 0.13 relative), so the 1e-5 tolerance catches any one adapter being lost or
mis-scaled.
"""
import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors import safe_open

from conftest import fixture_path
from mindqwen.lora import LoraConfig, adapter_state, apply_lora, load_adapter, lora_layers, save_adapter
from mindqwen.models.layers import Linear
from mindqwen.models.qwen import QwenForCausalLM

LOGIT_TOL = 1e-5
ADAPTER = fixture_path("qwen3_5", "qwen3_5_lora")
GOLDEN = dict(np.load(os.path.join(ADAPTER, "golden.npz")))
DELTANET = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# adapter_config.json fields that change what PEFT builds or how it scales it
MEANINGFUL = ("peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "bias", "fan_in_fan_out", "lora_bias",
              "layers_to_transform", "modules_to_save", "rank_pattern", "alpha_pattern")


@pytest.fixture(autouse=True)
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)


def rel(actual, ref) -> float:
    return float(np.abs(actual - ref).max() / np.abs(ref).max())


def base():
    return QwenForCausalLM.from_pretrained(fixture_path("qwen3_5", "qwen3_5_tiny"))


def logits(model) -> np.ndarray:
    return model(Tensor(GOLDEN["input_ids"].astype(np.int32))).asnumpy()


def peft_file(folder=ADAPTER) -> dict:
    with safe_open(os.path.join(folder, "adapter_model.safetensors"), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def peft_config(folder=ADAPTER) -> dict:
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
        return json.load(f)


def test_the_golden_can_tell_a_lost_adapter():
    adapted = [str(m) for m in GOLDEN["adapted_modules"]]
    assert len(adapted) == 31 and GOLDEN["drop_one_effect"].shape == (31,)
    assert GOLDEN["input_ids"].shape == (2, 80) and GOLDEN["logits"].shape == (2, 80, 128)
    print(f"least effect of one module's adapter: {GOLDEN['drop_one_effect'].min():.2f}; "
          f"of the whole adapter: {float(GOLDEN['lora_effect']):.2f}")
    assert GOLDEN["drop_one_effect"].min() >= 1e4 * LOGIT_TOL


def test_all_linear_adapts_exactly_the_modules_peft_adapts(tmp_path):
    model = base()
    plain = sorted(p for p, c in model.cells_and_names() if isinstance(c, Linear))
    model = apply_lora(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    ours, theirs = sorted(lora_layers(model)), [str(m) for m in GOLDEN["adapted_modules"]]
    assert ours == theirs, (sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours)))
    assert sorted(set(plain) - set(ours)) == ["lm_head"]
    for i in range(3):  # every Gated DeltaNet layer's five projections
        assert {f"model.layers.{i}.linear_attn.{p}" for p in DELTANET} <= set(ours)
    # The untrained adapter would be written under PEFT's keys with PEFT's shapes; B starts at zero.
    reference = peft_file()
    state = adapter_state(model)
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in reference.items()}
    assert not any(np.any(v) for k, v in state.items() if ".lora_B." in k)
    # Exported (as if trained), the "all-linear" adapter names what PEFT resolves and reloads as it was.
    rng = np.random.default_rng(5)
    for layer in lora_layers(model).values():
        layer.lora_b.set_data(Tensor(rng.normal(0, 0.2, layer.lora_b.shape).astype(np.float32)))
    folder = str(tmp_path / "a")
    save_adapter(model, folder)
    cfg, ref_cfg = peft_config(folder), peft_config()
    targets = cfg["target_modules"]
    # PEFT takes the keyword itself (resolving it to every Linear but the output layer, which mindqwen was
    # just shown to match) or a list of names; either way the set is PEFT's.
    resolved = {m.rsplit(".", 1)[-1] for m in theirs} if targets == "all-linear" else set(targets)
    assert resolved == set(ref_cfg["target_modules"])
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"], cfg["use_dora"]) == (4, 8, False, False)
    assert sorted(peft_file(folder)) == sorted(reference)
    again = load_adapter(base(), folder)
    assert sorted(lora_layers(again)) == ours
    mine = {p.name: p.asnumpy() for p in model.get_parameters()}
    for p in again.get_parameters():  # LoRA and base parameters alike (logits: next tests)
        assert np.array_equal(p.asnumpy(), mine[p.name]), p.name


@pytest.fixture(scope="module")
def peft_loaded():
    """mindqwen's Qwen3.5 with PEFT's adapter folder loaded, and its logits (one graph compile, shared)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    model = load_adapter(base(), ADAPTER)
    return model, logits(model)


def test_peft_adapter_gives_pefts_logits(peft_loaded):
    model, out = peft_loaded
    assert sorted(lora_layers(model)) == [str(m) for m in GOLDEN["adapted_modules"]]
    err = rel(out, GOLDEN["logits"])
    print(f"Qwen3.5 all-linear LoRA (PEFT's adapter) logits vs PEFT: {err:.1e}")
    assert err <= LOGIT_TOL


def test_export_is_pefts_layout_and_reimports_exactly(peft_loaded, tmp_path):
    model, loaded = peft_loaded
    reference, ref_cfg = peft_file(), peft_config()
    # Exported unchanged: PEFT's tensors, bit for bit, under PEFT's keys.
    save_adapter(model, str(tmp_path / "same"))
    same = peft_file(str(tmp_path / "same"))
    assert sorted(same) == sorted(reference)
    for k in reference:
        assert same[k].dtype == reference[k].dtype and np.array_equal(same[k], reference[k]), k
    # As if trained: every A and B moved; the export holds the new values and reimports to the same logits.
    # (On a model whose graph has not run yet: MindSpore 2.10 keeps a Parameter's old buffer in a no_inline
    # graph that has run, so set_data afterwards would not show in its logits; LoRA layers run in one.)
    model = load_adapter(base(), ADAPTER)
    rng = np.random.default_rng(3)
    for layer in lora_layers(model).values():
        for p in (layer.lora_a, layer.lora_b):
            p.set_data(Tensor(p.asnumpy() * 1.25 + rng.normal(0, 0.05, p.shape).astype(np.float32)))
    tuned = logits(model)
    assert rel(tuned, loaded) > 1e-2  # the perturbation shows
    folder = str(tmp_path / "tuned")
    save_adapter(model, folder)
    saved, cfg = peft_file(folder), peft_config(folder)
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {k: (v.shape, v.dtype) for k, v in reference.items()}
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    for k, v in saved.items():  # the file is the model's current adapter
        name = k[len("base_model.model."):].replace(".lora_A.weight", ".lora_a").replace(".lora_B.weight", ".lora_b")
        assert np.array_equal(v, params[name]), k
    assert set(cfg) <= set(ref_cfg)  # only fields PEFT itself writes
    for key in MEANINGFUL:
        assert cfg.get(key) == ref_cfg.get(key) or (not cfg.get(key) and not ref_cfg.get(key)), key
    assert cfg["task_type"] == ref_cfg["task_type"] and cfg["lora_dropout"] == ref_cfg["lora_dropout"]
    assert sorted(cfg["target_modules"]) == sorted(ref_cfg["target_modules"])
    again = load_adapter(base(), folder)
    assert np.array_equal(logits(again), tuned)
