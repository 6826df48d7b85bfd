"""LoRA: invariants, PEFT parity (logits, loss, gradients, merge) and adapter round trips.

References: ../shared/ref goldens (PEFT LoRA r8 on q,v; fixtures/REF_README.md) and
fixtures/qwen2_tiny/dora_rslora.npz (PEFT DoRA + rsLoRA, written by make_peft_extra.py).
"""
import hashlib
import json
import os
import shutil

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from conftest import MODELS, fixture_path, reference
from mindqwen import (LoraConfig, apply_lora, from_pretrained, load_adapter, merge_and_unload,
                      merge_lora, save_adapter, trainable_report, unmerge_lora)
from mindqwen.io.safetensors import SafetensorsFile
from mindqwen.lora import DoRALayer, LoRALayer, lora_layers
from mindqwen.models.layers import Linear

LOGITS_TOL, GRAD_RTOL = 5e-5, 1e-4
DORA = np.load(fixture_path("qwen2_tiny", "dora_rslora.npz"))


def base(name="qwen2_tiny"):
    return from_pretrained(fixture_path(name, "base"))


def ids_of(name="qwen2_tiny"):
    return ms.Tensor(reference(name)["input_ids"].astype(np.int32))


class LossAndGrads(nn.Cell):
    """Loss and its gradients w.r.t. the trainable parameters, compiled as one graph."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model
        self.params = ms.ParameterTuple(model.trainable_params())
        self.grad_fn = ms.value_and_grad(self.model, None, self.params)

    def construct(self, ids, labels):
        return self.grad_fn(ids, None, labels)


def grads_by_peft_key(model, ids):
    step = LossAndGrads(model)
    loss, grads = step(ids, ids)
    keys = [p.name.replace(".lora_a", ".lora_A.weight").replace(".lora_b", ".lora_B.weight")
            for p in step.params]
    return float(loss.asnumpy()), {"base_model.model." + k: g.asnumpy() for k, g in zip(keys, grads)}


def rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


# ------------------------------------------------------------------------------ invariants
def test_zero_b_leaves_the_output_unchanged(mode):
    ids = ids_of()
    plain = base()(ids).asnumpy()
    lora = apply_lora(base(), LoraConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))(ids).asnumpy()
    assert np.array_equal(plain, lora)


def test_a_step_moves_only_the_adapter(mode):
    model = apply_lora(base(), LoraConfig(r=4, lora_alpha=8))
    before = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    opt = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2)
    grad = LossAndGrads(model)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.grad, self.opt = grad, opt

        def construct(self, ids):
            loss, grads = self.grad(ids, ids)
            self.opt(grads)
            return loss

    step, ids = Step(), ids_of()
    losses = [float(step(ids).asnumpy()) for _ in range(3)]
    assert losses[-1] < losses[0]
    for p in model.get_parameters():
        changed = not np.array_equal(before[p.name], p.asnumpy())
        assert changed == (".lora_" in p.name), p.name


def test_the_private_recompile_hook_exists_and_restamps_every_cell():
    """models/graph.py writes MindSpore's private Cell._create_time (no public reset exists); the
    graph-mode merge test below is what breaks if the stamp stops invalidating graphs."""
    from mindqwen.models.graph import invalidate_compiled_graphs
    model = base()
    before = {name: cell._create_time for name, cell in model.cells_and_names()}
    invalidate_compiled_graphs(model)
    after = {name: cell._create_time for name, cell in model.cells_and_names()}
    assert before.keys() == after.keys() and all(after[n] != before[n] for n in before)


def test_save_pretrained_refuses_a_model_with_adapters(tmp_path):
    model = apply_lora(base(), LoraConfig(r=4))
    with pytest.raises(ValueError, match=r"save_adapter\(model, folder\).*merge_and_unload\(model\)\.save_pretrained"):
        model.save_pretrained(str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    merge_lora(model)  # merged but not unloaded: the LoRA tensors are still there
    with pytest.raises(ValueError, match="has LoRA adapters"):
        model.save_pretrained(str(tmp_path / "out"))
    merge_and_unload(model).save_pretrained(str(tmp_path / "out"))
    assert not [k for k in SafetensorsFile(str(tmp_path / "out" / "model.safetensors")).keys() if "lora" in k]


@pytest.mark.parametrize("name", MODELS)
def test_saved_merged_lora_model_is_the_folder_transformers_and_peft_write(name, tmp_path):
    """``merge_and_unload(load_adapter(...)).save_pretrained`` writes what transformers + PEFT's
    ``merge_and_unload().save_pretrained`` wrote (the golden ``merged/``): the same tensor names,
    the same values (≤ 1e-6), a config.json that agrees on every field transformers reads; and
    both mindqwen's loader and the reference logits see the LoRA model, not the base."""
    model = merge_and_unload(load_adapter(base(name), fixture_path(name, "lora_adapter")))
    model.save_pretrained(str(tmp_path / "out"))
    ours = SafetensorsFile(str(tmp_path / "out" / "model.safetensors"))
    theirs = SafetensorsFile(fixture_path(name, "merged", "model.safetensors"))
    assert sorted(ours.keys()) == sorted(theirs.keys())
    worst = max(float(np.abs(ours.get(k) - theirs.get(k)).max()) for k in theirs.keys())
    print(f"{name}: saved merged weights vs transformers + PEFT: max |Δ| = {worst:.1e}")
    assert worst <= 1e-6
    with open(tmp_path / "out" / "config.json") as f, open(fixture_path(name, "merged", "config.json")) as g:
        ours_cfg, theirs_cfg = json.load(f), json.load(g)
    shared = set(ours_cfg) & set(theirs_cfg) - {"transformers_version", "dtype", "torch_dtype"}
    assert {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_key_value_heads",
            "vocab_size", "tie_word_embeddings"} <= shared
    assert {k: ours_cfg[k] for k in shared} == {k: theirs_cfg[k] for k in shared}
    logits = from_pretrained(str(tmp_path / "out"))(ids_of(name)).asnumpy()
    ref = reference(name)
    np.testing.assert_allclose(logits, ref["logits_lora"], atol=5e-5)
    assert np.abs(ref["logits_lora"] - ref["logits"]).max() > 1e-2  # the adapter matters


def test_merge_is_w_plus_scaled_ba_and_unmerge_restores(mode):
    model = apply_lora(base(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    rng = np.random.default_rng(0)
    for layer in lora_layers(model).values():
        layer.lora_b.set_data(ms.Tensor(rng.normal(0, 0.1, layer.lora_b.shape).astype(np.float32)))
    ids = ids_of()
    unmerged = model(ids).asnumpy()
    w0 = {path: (l.weight.asnumpy().copy(), l.lora_a.asnumpy(), l.lora_b.asnumpy()) for path, l in lora_layers(model).items()}
    merge_lora(model)
    merge_lora(model)  # twice is a no-op
    for path, layer in lora_layers(model).items():
        w, a, b = w0[path]
        np.testing.assert_allclose(layer.weight.asnumpy(), w + (8 / 4) * b @ a, atol=1e-6)
    merged = model(ids).asnumpy()  # the cached unmerged graph must not be reused
    assert np.abs(merged - unmerged).max() <= LOGITS_TOL
    unmerge_lora(model)
    for path, layer in lora_layers(model).items():
        assert np.abs(layer.weight.asnumpy() - w0[path][0]).max() <= 1e-6


def _expected_trainable(config_json, targets, r, dora=False):
    """Closed form: r·(in + out) per targeted projection (+ out for DoRA), per layer."""
    c = json.load(open(config_json))
    h, i, n, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim", h // n)
    shapes = {"q_proj": (h, n * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d), "o_proj": (n * d, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    per_layer = sum(r * (shapes[t][0] + shapes[t][1]) + (shapes[t][1] if dora else 0) for t in targets)
    return c["num_hidden_layers"] * per_layer


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("targets,dora", [(["q_proj", "v_proj"], False),
                                          (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
                                          (["o_proj", "down_proj"], True)])
def test_trainable_parameter_count_is_closed_form(name, targets, dora):
    model = apply_lora(base(name), LoraConfig(r=8, target_modules=targets, use_dora=dora))
    expected = _expected_trainable(fixture_path(name, "base", "config.json"), targets, 8, dora)
    assert sum(int(np.prod(p.shape)) for p in model.trainable_params()) == expected
    assert f"trainable params: {expected:,} ||" in trainable_report(model)


def test_layers_to_transform_and_regex_targets():
    model = apply_lora(base(), LoraConfig(target_modules=r".*\.self_attn\.(q|k)_proj", layers_to_transform=[1]))
    assert sorted(lora_layers(model)) == ["model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.q_proj"]


def test_bias_modes():
    model = apply_lora(base(), LoraConfig(bias="lora_only"))
    trainable_biases = sorted(p.name for p in model.trainable_params() if p.name.endswith(".bias"))
    assert trainable_biases == [f"model.layers.{i}.self_attn.{m}.bias" for i in (0, 1) for m in ("q_proj", "v_proj")]
    model = apply_lora(base(), LoraConfig(bias="all"))
    assert len([p for p in model.trainable_params() if p.name.endswith(".bias")]) == 6


def test_base_keys_are_unchanged_by_lora():
    plain = sorted(p.name for p in base().get_parameters())
    lora = sorted(p.name for p in apply_lora(base()).get_parameters() if ".lora_" not in p.name)
    assert plain == lora


def test_unknown_target_is_a_clear_error():
    with pytest.raises(ValueError, match=r"target_modules=\['qkv_proj'\] matches no module .*q_proj"):
        apply_lora(base(), LoraConfig(target_modules=["qkv_proj"]))
    with pytest.raises(ValueError, match="modules_to_save: no module named 'score'"):
        apply_lora(base(), LoraConfig(modules_to_save=["score"]))


# ------------------------------------------------------------------------------ PEFT parity
@pytest.mark.parametrize("name", MODELS)
def test_peft_adapter_logits_loss_and_grads_match(name, mode):
    ref, ids = reference(name), ids_of(name)
    model = load_adapter(base(name), fixture_path(name, "lora_adapter"))
    err = np.abs(model(ids).asnumpy() - ref["logits_lora"]).max()
    print(f"{name} [{mode}] LoRA logits max-abs error vs PEFT: {err:.2e}")
    assert err <= LOGITS_TOL
    loss, grads = grads_by_peft_key(model, ids)
    assert abs(loss - float(ref["loss_lora"])) <= 1e-5
    ref_grads = {k[len("grad/"):]: ref[k] for k in ref.files if k.startswith("grad/")}
    assert grads.keys() == ref_grads.keys()
    worst = max(rel(grads[k], ref_grads[k]) for k in grads)
    print(f"  worst relative gradient error: {worst:.2e}")
    assert worst <= GRAD_RTOL


@pytest.mark.parametrize("name", MODELS)
def test_peft_grads_match_with_the_loss_in_chunks(name):
    """The chunked loss's hand-written backward (5 rows a chunk of 30) against PEFT's gradients."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ref, ids = reference(name), ids_of(name)
    model = load_adapter(base(name), fixture_path(name, "lora_adapter"))
    model.chunked_loss.rows = 5
    loss, grads = grads_by_peft_key(model, ids)
    assert abs(loss - float(ref["loss_lora"])) <= 1e-5
    assert max(rel(grads[k], ref[f"grad/{k}"]) for k in grads) <= GRAD_RTOL

@pytest.mark.parametrize("name", MODELS)
def test_merge_and_unload_matches_peft_merged_logits(name):
    ref, ids = reference(name), ids_of(name)
    model = merge_and_unload(load_adapter(base(name), fixture_path(name, "lora_adapter")))
    assert not lora_layers(model)
    assert all(type(c) is not LoRALayer for _, c in model.cells_and_names())
    assert np.abs(model(ids).asnumpy() - ref["logits_merged"]).max() <= LOGITS_TOL
    assert sorted(p.name for p in model.get_parameters()) == sorted(p.name for p in base(name).get_parameters())


def test_dora_rslora_match_peft(mode):
    ids = ms.Tensor(DORA["input_ids"].astype(np.int32))
    model = load_adapter(base(), fixture_path("qwen2_tiny", "dora_rslora_adapter"))
    layer = lora_layers(model)["model.layers.0.self_attn.q_proj"]
    assert layer.use_dora and layer.scaling == pytest.approx(8 / 2)  # rsLoRA: alpha / sqrt(r)
    err = np.abs(model(ids).asnumpy() - DORA["logits"]).max()
    print(f"DoRA+rsLoRA [{mode}] logits max-abs error vs PEFT: {err:.2e}")
    assert err <= LOGITS_TOL
    loss, grads = grads_by_peft_key(model, ids)
    assert abs(loss - float(DORA["loss"])) <= 1e-5
    ref_grads = {k[len("grad/"):]: DORA[k] for k in DORA.files if k.startswith("grad/")}
    assert grads.keys() == ref_grads.keys()  # includes every lora_magnitude_vector
    assert max(rel(grads[k], ref_grads[k]) for k in grads) <= GRAD_RTOL
    merge_lora(model)
    assert np.abs(model(ids).asnumpy() - DORA["logits_merged"]).max() <= LOGITS_TOL


def test_rslora_only_matches_peft():
    model = load_adapter(base(), fixture_path("qwen2_tiny", "rslora_adapter"))
    logits = model(ms.Tensor(DORA["input_ids"].astype(np.int32))).asnumpy()
    assert np.abs(logits - DORA["rslora/logits"]).max() <= LOGITS_TOL


def _one_layer(config, seed=0):
    rng = np.random.default_rng(seed)
    lin = Linear(16, 12, True)
    w, b = rng.normal(0, 0.3, (12, 16)).astype(np.float32), rng.normal(0, 0.1, 12).astype(np.float32)
    lin.weight.set_data(ms.Tensor(w))
    lin.bias.set_data(ms.Tensor(b))
    layer = (DoRALayer if config.use_dora else LoRALayer)(lin, config, "proj")
    a, bb = rng.normal(0, 0.2, (config.r, 16)).astype(np.float32), rng.normal(0, 0.2, (12, config.r)).astype(np.float32)
    layer.lora_a.set_data(ms.Tensor(a))
    layer.lora_b.set_data(ms.Tensor(bb))
    x = rng.normal(0, 1, (3, 5, 16)).astype(np.float32)
    return layer, x, w, b, a, bb


def test_rslora_layer_equals_numpy_formula():
    layer, x, w, b, a, bb = _one_layer(LoraConfig(r=4, lora_alpha=6, use_rslora=True))
    x64 = x.astype(np.float64)
    expected = x64 @ w.T + b + (6 / np.sqrt(4)) * (x64 @ a.T) @ bb.T
    np.testing.assert_allclose(layer(ms.Tensor(x)).asnumpy(), expected, atol=2e-6)


def test_dora_layer_equals_numpy_formula():
    layer, x, w, b, a, bb = _one_layer(LoraConfig(r=4, lora_alpha=8, use_dora=True))
    m = np.linspace(0.5, 1.5, 12)
    layer.lora_magnitude_vector.set_data(ms.Tensor(m.astype(np.float32)))
    wd = w.astype(np.float64) + 2.0 * bb @ a  # s = 8/4
    expected = (x.astype(np.float64) @ wd.T) * (m / np.linalg.norm(wd, axis=1)) + b
    np.testing.assert_allclose(layer(ms.Tensor(x)).asnumpy(), expected, atol=2e-6)


def test_dora_is_its_own_class_and_merge_round_trips():
    """The class decides DoRA (a mismatched config is refused, not trained as plain LoRA); a DoRA
    layer merges to m/‖W + s·B·A‖ ⊙ (W + s·B·A) and unmerges back to W."""
    with pytest.raises(ValueError, match="use_dora=True takes DoRALayer"):
        LoRALayer(Linear(16, 12, True), LoraConfig(r=4, use_dora=True), "proj")
    with pytest.raises(ValueError, match="use_dora=False takes LoRALayer"):
        DoRALayer(Linear(16, 12, True), LoraConfig(r=4), "proj")
    layer, x, w, b, a, bb = _one_layer(LoraConfig(r=4, lora_alpha=8, use_dora=True))
    assert isinstance(layer, LoRALayer) and layer.use_dora and layer._dora_factor is None
    wd = w.astype(np.float64) + 2.0 * bb.astype(np.float64) @ a
    expected = wd * (layer.lora_magnitude_vector.asnumpy() / np.linalg.norm(wd, axis=1))[:, None]
    np.testing.assert_allclose(layer.merged_weight_np(), expected, rtol=1e-6)
    before = layer(ms.Tensor(x)).asnumpy()
    layer.merge()
    np.testing.assert_allclose(layer(ms.Tensor(x)).asnumpy(), before, atol=2e-6)
    layer.unmerge()
    np.testing.assert_allclose(layer.weight.asnumpy(), w, atol=1e-6)


def test_lora_dropout_drops_the_adapter_input_and_rescales():
    """A = B = I, W = 0, scaling 1: the layer's output is the dropped input itself, each entry 0 or
    x / (1 - p), kept with probability 1 - p while training; untouched in eval."""
    p = 0.25
    lin = Linear(16, 16, False)
    lin.weight.set_data(ms.Tensor(np.zeros((16, 16), np.float32)))
    layer = LoRALayer(lin, LoraConfig(r=16, lora_alpha=16, lora_dropout=p), "proj")
    layer.lora_a.set_data(ms.Tensor(np.eye(16, dtype=np.float32)))
    layer.lora_b.set_data(ms.Tensor(np.eye(16, dtype=np.float32)))
    x = np.ones((1000, 16), np.float32)
    layer.set_train(True)
    out = layer(ms.Tensor(x)).asnumpy()
    np.testing.assert_allclose(np.unique(out), [0.0, 1 / (1 - p)], rtol=1e-6)
    assert abs((out > 0).mean() - (1 - p)) < 0.02  # 16,000 draws: σ = 0.0034
    layer.set_train(False)
    np.testing.assert_array_equal(layer(ms.Tensor(x)).asnumpy(), x)


# ------------------------------------------------------------------------------ recompute
def test_recompute_gives_the_same_lora_gradients(mode):
    ids = ids_of("qwen3_tiny")
    ref_model = load_adapter(base("qwen3_tiny"), fixture_path("qwen3_tiny", "lora_adapter"))
    _, plain = grads_by_peft_key(ref_model, ids)
    model = load_adapter(base("qwen3_tiny"), fixture_path("qwen3_tiny", "lora_adapter"))
    for layer in model.model.layers:
        layer.recompute()
    _, recomputed = grads_by_peft_key(model, ids)
    assert all(np.abs(recomputed[k]).max() > 0 for k in recomputed)  # the known trap: zero grads
    assert max(np.abs(recomputed[k] - plain[k]).max() for k in plain) <= 1e-6


# ------------------------------------------------------------------------------ adapter files
def _digest(folder):
    return {n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest() for n in sorted(os.listdir(folder))}


@pytest.mark.parametrize("name", MODELS)
def test_adapter_round_trip_is_exact_and_user_files_untouched(name, tmp_path):
    src = str(tmp_path / "user_adapter")
    shutil.copytree(fixture_path(name, "lora_adapter"), src)
    digest = _digest(src)
    model = load_adapter(base(name), src)
    assert _digest(src) == digest
    save_adapter(model, str(tmp_path / "saved"))
    original, saved = SafetensorsFile(os.path.join(src, "adapter_model.safetensors")), \
        SafetensorsFile(str(tmp_path / "saved" / "adapter_model.safetensors"))
    assert sorted(saved.keys()) == sorted(original.keys())
    for k in original.keys():
        assert np.array_equal(saved.get(k), original.get(k)), k
    ours = json.load(open(tmp_path / "saved" / "adapter_config.json"))
    theirs = json.load(open(os.path.join(src, "adapter_config.json")))
    assert set(ours) <= set(theirs)  # only fields PEFT itself writes
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "bias", "use_rslora", "use_dora",
                "init_lora_weights", "fan_in_fan_out", "layers_to_transform", "modules_to_save"):
        assert ours[key] == theirs[key], key
    assert sorted(ours["target_modules"]) == sorted(theirs["target_modules"])


def test_modules_to_save_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    model = apply_lora(base("qwen3_tiny"), LoraConfig(r=2, modules_to_save=["lm_head"]))
    assert model.lm_head.weight.requires_grad
    model.lm_head.weight.set_data(ms.Tensor(rng.normal(0, 0.3, model.lm_head.weight.shape).astype(np.float32)))
    save_adapter(model, str(tmp_path / "a"))
    keys = set(SafetensorsFile(str(tmp_path / "a" / "adapter_model.safetensors")).keys())
    assert "base_model.model.lm_head.weight" in keys  # PEFT's saved name (helper-verified)
    again = load_adapter(base("qwen3_tiny"), str(tmp_path / "a"))
    assert np.array_equal(again.lm_head.weight.asnumpy(), model.lm_head.weight.asnumpy())


def test_pissa_starts_at_the_base_and_exports_relative_to_it(tmp_path):
    ids = ids_of()
    plain = base()(ids).asnumpy()
    model = apply_lora(base(), LoraConfig(r=4, lora_alpha=8, init="pissa"))
    assert np.abs(model(ids).asnumpy() - plain).max() <= 5e-5
    for layer in lora_layers(model).values():  # as if trained
        layer.lora_b.set_data(layer.lora_b * 1.1)
    tuned = model(ids).asnumpy()
    save_adapter(model, str(tmp_path / "p"))
    assert json.load(open(tmp_path / "p" / "adapter_config.json"))["r"] == 8
    reloaded = load_adapter(base(), str(tmp_path / "p"))  # onto the untouched base checkpoint
    assert np.abs(reloaded(ids).asnumpy() - tuned).max() <= 5e-5


@pytest.mark.parametrize("field,value", [("rank_pattern", {"q_proj": 4}), ("fan_in_fan_out", True),
                                         ("peft_type", "IA3")])
def test_unsupported_adapter_features_name_the_key(tmp_path, field, value):
    src = str(tmp_path / "a")
    shutil.copytree(fixture_path("qwen2_tiny", "lora_adapter"), src)
    cfg = json.load(open(os.path.join(src, "adapter_config.json")))
    cfg[field] = value
    json.dump(cfg, open(os.path.join(src, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match=f"adapter_config.json: .*{field if field != 'peft_type' else 'IA3'}"):
        load_adapter(base(), src)


def test_adapter_for_a_module_the_model_lacks(tmp_path):
    src = str(tmp_path / "a")
    shutil.copytree(fixture_path("qwen3_tiny", "lora_adapter"), src)  # q/k/v/o/mlp targets, 128-wide q
    with pytest.raises(Exception, match=r"adapter_model.safetensors: tensor .* has shape"):
        load_adapter(base("qwen2_tiny"), src)


def test_saved_adapter_loads_in_peft(tmp_path):
    """Only where torch + transformers + peft are installed (not project dependencies)."""
    torch = pytest.importorskip("torch", reason="torch not installed: PEFT load check skipped")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = load_adapter(base("qwen3_tiny"), fixture_path("qwen3_tiny", "lora_adapter"))
    save_adapter(model, str(tmp_path / "a"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(fixture_path("qwen3_tiny", "base"), dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, str(tmp_path / "a"))
    with torch.no_grad():
        logits = hf(torch.tensor(reference("qwen3_tiny")["input_ids"])).logits.numpy()
    assert np.abs(logits - reference("qwen3_tiny")["logits_lora"]).max() <= LOGITS_TOL


def test_adapter_stays_fp32_over_a_fp16_base():
    """As PEFT's autocast_adapter_dtype: a fp16/bf16 base keeps fp32 adapters (AdamW steps of
    ~1e-4·|w| would round away in a low-precision adapter); the forward still matches PEFT."""
    ref = reference("qwen2_tiny")
    model = load_adapter(from_pretrained(fixture_path("qwen2_tiny", "base"), "float16"),
                         fixture_path("qwen2_tiny", "lora_adapter"))
    layer = lora_layers(model)["model.layers.0.self_attn.q_proj"]
    assert layer.weight.dtype == ms.float16 and layer.lora_a.dtype == ms.float32 and layer.lora_b.dtype == ms.float32
    logits = model(ms.Tensor(ref["input_ids"].astype(np.int32))).asnumpy().astype(np.float32)
    scale = np.abs(ref["logits_lora"]).max()
    assert np.abs(logits - ref["logits_lora"]).max() < 5e-3 * scale  # fp16 rounding of an fp32 reference


def test_lora_config_takes_pefts_keywords_honoured_or_refused_by_name():
    # the call Qwen fine-tuning guides use with PEFT
    c = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_alpha=32, lora_dropout=0.1, bias="none",
                   task_type="CAUSAL_LM")
    assert (c.r, c.lora_alpha, c.lora_dropout, c.scaling) == (8, 32, 0.1, 4.0)
    assert LoraConfig(init_lora_weights="gaussian").init == "gaussian" and LoraConfig(init_lora_weights=True).init == "default"
    assert LoraConfig(inference_mode=True, base_model_name_or_path="Qwen/Qwen2.5-0.5B", rank_pattern={}).r == 8
    for keywords, needle in [({"task_type": "SEQ_CLS"}, "task_type='SEQ_CLS' is not supported: mindqwen adapts causal"),
                             ({"fan_in_fan_out": True}, "fan_in_fan_out=True is not supported"),
                             ({"init_lora_weights": "olora"}, "init_lora_weights='olora' is not supported"),
                             ({"rank_pattern": {"q_proj": 4}}, "rank_pattern=.* per-module ranks"),
                             ({"use_bdlora": True}, "use_bdlora=True is not supported")]:
        with pytest.raises(ValueError, match=needle):
            LoraConfig(**keywords)
