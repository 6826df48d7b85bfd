"""Qwen2-MoE and Qwen3-MoE against HF transformers + PEFT (fixtures/REF_README.md, ``*_moe_tiny``):
logits, hidden states, router logits, the cross-entropy and HF's load-balancing loss, greedy
generation with the KV cache, a PEFT adapter's logits and gradients, merge; and training through
``fit`` (gradients reach exactly the experts that received tokens)."""
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from conftest import MOE_MODELS, fixture_path, reference
from mindqwen import QwenConfig, QwenForCausalLM, from_pretrained, generate, load_adapter, merge_and_unload
from mindqwen.config import ConfigError
from mindqwen.io.hf import model_state
from test_generation import _cached_logits, _full_logits, _padded_batch
from test_lora import grads_by_peft_key, rel

LOGITS_TOL = 5e-5  # the reference README's bound for fp32 logits
TOL = 1e-5  # hidden states; losses relative
GRAD_RTOL = 1e-4


def base(name, aux_loss=True):
    model = from_pretrained(fixture_path(name, "base"))
    if not aux_loss:  # PEFT's reference loss is HF's default: the cross-entropy alone
        model.aux_loss_coef = 0.0
    return model


def ids_of(name):
    return Tensor(reference(name)["input_ids"].astype(np.int32))


class Everything(nn.Cell):
    """One graph for all a forward pass reports: logits, hidden states, router logits, and the
    training loss (cross-entropy + coef · aux) with its aux term."""

    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, ids):
        h, hidden, router_logits = self.model.model.run(ids)
        loss, aux = self.model.loss_and_aux_loss(ids, None, ids)
        return self.model.logits(h), hidden, router_logits, loss, aux


@pytest.mark.parametrize("name", MOE_MODELS)
def test_logits_router_logits_and_losses_match_hf_in_graph_mode(name):
    ms.set_context(mode=ms.GRAPH_MODE)
    ref, ids, model = reference(name), ids_of(name), base(name)
    logits, hidden, router_logits, loss_with_aux, aux = Everything(model)(ids)
    err = np.abs(logits.asnumpy() - ref["logits"]).max()
    print(f"{name} logits max-abs error vs HF: {err:.2e}")
    assert err <= LOGITS_TOL

    assert len(hidden) == len(ref["hidden_states"])
    assert max(np.abs(h.asnumpy() - r).max() for h, r in zip(hidden, ref["hidden_states"])) <= TOL
    router = np.stack([r.asnumpy() for r in router_logits])
    assert router.shape == ref["router_logits"].shape
    assert np.abs(router - ref["router_logits"]).max() <= LOGITS_TOL  # logits too: |x| reaches 11
    # The experts each token picks: HF's top-k of the same logits.
    assert np.array_equal(np.sort(np.argsort(-router, -1)[..., :2], -1),
                          np.sort(np.argsort(-ref["router_logits"], -1)[..., :2], -1))

    loss_with_aux, aux = float(loss_with_aux.asnumpy()), float(aux.asnumpy())
    print(f"  loss+aux {loss_with_aux:.7f} vs HF {float(ref['loss_with_aux']):.7f}; "
          f"aux {aux:.7f} vs HF {float(ref['aux_loss']):.7f}")
    assert abs(loss_with_aux / float(ref["loss_with_aux"]) - 1) <= TOL
    assert abs(aux / float(ref["aux_loss"]) - 1) <= TOL
    assert model.aux_loss_coef == 0.001  # router_aux_loss_coef of config.json
    ce = loss_with_aux - model.aux_loss_coef * aux
    assert abs(ce / float(ref["loss"]) - 1) <= TOL  # HF's default loss: the cross-entropy alone


def test_the_batched_exact_path_of_sharded_layers_matches_hf():
    """Under semi-auto parallel the exact path runs the experts as (E, N, H) batches (one shard
    layout of the weights in every graph); on CPU it is the same function: HF's logits."""
    ref, model = reference("qwen2_moe_tiny"), base("qwen2_moe_tiny")
    for layer in model.model.layers:
        if layer.sparse:
            layer.mlp.batched = True
    assert np.abs(model(ids_of("qwen2_moe_tiny")).asnumpy() - ref["logits"]).max() <= LOGITS_TOL


def test_model_call_adds_the_weighted_aux_loss_and_coef_zero_leaves_the_cross_entropy():
    ref, ids = reference("qwen2_moe_tiny"), ids_of("qwen2_moe_tiny")
    assert abs(float(base("qwen2_moe_tiny")(ids, labels=ids).asnumpy()) - float(ref["loss_with_aux"])) <= 1e-5
    assert abs(float(base("qwen2_moe_tiny", aux_loss=False)(ids, labels=ids).asnumpy()) - float(ref["loss"])) <= 1e-5


def test_load_balancing_loss_with_padding_is_the_closed_form():
    """HF's masked formula in numpy: padded tokens count neither in f_e nor in P_e."""
    model = base("qwen3_moe_tiny")
    ids = ids_of("qwen3_moe_tiny")
    mask = np.ones(ids.shape, np.int32)
    mask[0, :5] = 0
    aux = float(model.aux_loss(ids, Tensor(mask)).asnumpy())
    logits = np.stack([r.asnumpy() for r in model.model.run(ids, Tensor(mask))[2]]).astype(np.float64)  # (L, N, E)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    picked = np.zeros_like(p)
    np.put_along_axis(picked, np.argsort(-p, -1)[..., :2], 1.0, -1)
    keep = mask.reshape(1, -1, 1).astype(bool)
    share = (picked * keep).sum((0, 1)) / (keep.sum() * len(p))
    prob = (p * keep).sum((0, 1)) / (keep.sum() * len(p))
    expected = 4 * (share * prob).sum()
    assert abs(aux - expected) <= 1e-6 * expected


@pytest.mark.parametrize("name", MOE_MODELS)
def test_greedy_generation_with_the_kv_cache_equals_hf(name):
    ref = reference(name)
    out = generate(base(name), ref["gen_ids"][:1, :16], max_new_tokens=8)
    assert np.array_equal(out, ref["gen_ids"])


def test_kv_cache_logits_equal_full_recompute():
    name = "qwen2_moe_tiny"  # the shared expert too
    model = base(name)
    rng = np.random.default_rng(3)
    ids, mask = _padded_batch(model.config.vocab_size, rng)
    new = rng.integers(0, model.config.vocab_size, (3, 5)).astype(np.int32)
    full = _full_logits(model, ids, mask, new)
    ms.set_context(mode=ms.GRAPH_MODE)
    diff = max(float(np.abs(c - f).max()) for c, f in zip(_cached_logits(model, ids, mask, new), full))
    print(f"{name}: KV cache vs full recompute, max |Δlogit| over 6 steps = {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("name", MOE_MODELS)
def test_peft_adapter_logits_grads_and_merge_match(name):
    ms.set_context(mode=ms.GRAPH_MODE)
    ref, ids = reference(name), ids_of(name)
    model = load_adapter(base(name, aux_loss=False), fixture_path(name, "lora_adapter"))
    loss, grads = grads_by_peft_key(model, ids)
    assert abs(loss - float(ref["loss_lora"])) <= TOL * float(ref["loss_lora"])
    ref_grads = {k[len("grad/"):]: ref[k] for k in ref.files if k.startswith("grad/")}
    assert grads.keys() == ref_grads.keys()
    worst = max(rel(grads[k], ref_grads[k]) for k in grads)
    print(f"{name} LoRA worst relative gradient error vs PEFT: {worst:.2e}")
    assert worst <= GRAD_RTOL
    ms.set_context(mode=ms.PYNATIVE_MODE)
    err = np.abs(model(ids).asnumpy() - ref["logits_lora"]).max()
    print(f"  LoRA logits max-abs error vs PEFT: {err:.2e}")
    assert err <= LOGITS_TOL
    merged = merge_and_unload(model)
    assert np.abs(merged(ids).asnumpy() - ref["logits_merged"]).max() <= LOGITS_TOL


def test_sparse_layers_follow_hfs_rule_and_bad_configs_name_the_field():
    cfg = QwenConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24,
                     num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                     moe_intermediate_size=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [cfg.is_sparse(i) for i in range(4)] == [False, True, False, False]
    model = QwenForCausalLM(cfg)
    assert {k: tuple(t.shape) for k, t in model_state(model).items()} == cfg.tensor_shapes()  # HF layout
    params = {p.name: tuple(p.shape) for p in model.get_parameters()}  # the experts stacked [E, out, in]
    assert (params["model.layers.1.mlp.experts.gate_proj.weight"], params["model.layers.1.mlp.experts.down_proj.weight"]) \
        == ((4, 8, 16), (4, 16, 8))
    for kwargs, field in (({"num_experts_per_tok": 5}, "num_experts_per_tok"), ({"moe_intermediate_size": 0},
                          "moe_intermediate_size"), ({"mlp_only_layers": [4]}, "mlp_only_layers")):
        with pytest.raises(ConfigError, match=field):
            QwenConfig(**{**dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8,
                                 num_hidden_layers=4), **kwargs})
    with pytest.raises(ConfigError, match="num_experts=4 needs a mixture-of-experts model_type"):
        QwenConfig(num_experts=4)
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        QwenConfig(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=8)


@pytest.mark.parametrize("name", MOE_MODELS)
def test_hf_config_round_trip(name):
    cfg = QwenConfig.from_hf(fixture_path(name, "base"))
    assert QwenConfig.from_hf(cfg.to_hf()) == cfg
    assert cfg.num_experts == 4 and cfg.norm_topk_prob == (name == "qwen3_moe_tiny")


def tiny_moe(seed=0, **overrides):
    ms.set_seed(seed)
    cfg = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=1,
               moe_intermediate_size=16, norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=64,
               qkv_bias=False, qk_norm=True)
    return QwenForCausalLM(QwenConfig(**{**cfg, **overrides}))


def test_gradients_reach_exactly_the_experts_that_received_tokens():
    """Four tokens, top-1 of 8 experts: at most 4 experts per layer get tokens. Their weights get
    gradients; the others get exact zeros (the router itself learns from the aux loss too). The last
    token has no label after it: its expert in the last layer reaches neither loss (in an earlier
    layer it does, through the next layer's router and the aux loss)."""
    model = tiny_moe()
    ids = Tensor(np.array([[5, 17, 33, 50]], np.int32))
    logits = [r.asnumpy() for r in model.model.run(ids)[2]]
    logits[-1] = logits[-1][:-1]
    routed = [set(np.argmax(r, -1).tolist()) for r in logits]
    assert all(len(r) < 8 for r in routed)
    params = model.trainable_params()
    _, grads = ms.value_and_grad(model, None, params)(ids, None, ids)
    grads = {p.name: g.asnumpy() for p, g in zip(params, grads)}
    for layer, experts in enumerate(routed):
        for e in range(8):
            norms = [np.abs(grads[f"model.layers.{layer}.mlp.experts.{proj}.weight"][e]).max()
                     for proj in ("gate_proj", "up_proj", "down_proj")]
            assert all(n > 0 for n in norms) if e in experts else all(n == 0 for n in norms), (layer, e, norms)
        assert np.abs(grads[f"model.layers.{layer}.mlp.gate.weight"]).min() > 0  # every router row learns


def test_a_tiny_moe_trains_through_fit_with_the_aux_loss_logged(tmp_path):
    import json

    from mindqwen import TokenDataset, TrainerConfig, fit
    model = tiny_moe(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01)
    data = np.random.default_rng(0).integers(0, 64, (8, 12))
    config = TrainerConfig(max_steps=30, micro_batch_size=8, lr=1e-2, warmup_steps=0,
                           output_dir=str(tmp_path), progress=False)
    summary = fit(model, TokenDataset(data), config)
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    ids = Tensor(data.astype(np.int32))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    aux = float(model.aux_loss(ids).asnumpy())  # after the last update; the log has it before
    assert rows[-1]["aux_loss"] > 0 and abs(aux - rows[-1]["aux_loss"]) < 0.5 * aux
    reloaded = QwenForCausalLM.from_pretrained(summary["outputs"]["model"])
    assert np.array_equal(reloaded(ids).asnumpy(), model(ids).asnumpy())


# ------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("name,fmt,file,qkv", [
    ("qwen2_moe_tiny", "ms-ckpt", "x.ckpt", None), ("qwen2_moe_tiny", "mindformers", "x.ckpt", "interleaved"),
    ("qwen3_moe_tiny", "ms-ckpt", "x.ckpt", None), ("qwen3_moe_tiny", "mindformers-mcore", "x.safetensors", "interleaved"),
    ("qwen3_moe_tiny", "mindformers-mcore", "x.ckpt", None)])
def test_checkpoint_round_trips_are_bit_exact(name, fmt, file, qkv, tmp_path):
    from mindqwen.io.convert import convert, read_state
    src = fixture_path(name, "base")
    convert(src, str(tmp_path / file), "hf", fmt, src, qkv=qkv)
    convert(str(tmp_path / file), str(tmp_path / "back"), fmt, "hf", src, qkv=qkv)
    original, back = read_state(src), read_state(str(tmp_path / "back"))
    assert set(back) == set(original)
    assert all(np.array_equal(back[k].load(), original[k].load()) for k in original)
    ids = ids_of(name)
    direct = base(name)(ids).asnumpy()
    assert np.array_equal(QwenForCausalLM.from_checkpoint(str(tmp_path / file), fmt, src, qkv)(ids).asnumpy(), direct)
    if fmt == "ms-ckpt":  # the model's own names (experts stacked): MindSpore's own loader takes it whole
        model = QwenForCausalLM(QwenConfig.from_hf(src))
        assert ms.load_param_into_net(model, ms.load_checkpoint(str(tmp_path / file)))[0] == []
        assert np.array_equal(model(ids).asnumpy(), direct)


def test_mindformers_expert_layouts_are_what_their_converters_write(tmp_path):
    """Read back as mindformers' own scripts do: Mcore ``reverse_mcore_qwen3_moe_weight_to_hf.py``
    (weight1.reshape(E, H, 2I).transpose(0, 2, 1), gate rows first), legacy
    ``convert_moe_weight.py`` (torch.stack(experts).permute(0, 2, 1))."""
    from mindqwen.io.convert import convert, read_state
    for name, fmt, router in (("qwen3_moe_tiny", "mindformers-mcore", "decoder.layers.1.mlp.router.weight"),
                              ("qwen2_moe_tiny", "mindformers", "model.layers.1.feed_forward.routed_experts.router.dense.weight")):
        src = fixture_path(name, "base")
        hf = {k: t.load() for k, t in read_state(src).items()}
        convert(src, str(tmp_path / f"{name}.safetensors"), "hf", fmt, src)
        mf = {k: t.load() for k, t in read_state(str(tmp_path / f"{name}.safetensors")).items()}
        assert np.array_equal(mf[router], hf["model.layers.1.mlp.gate.weight"])
        gate = np.stack([hf[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])  # (E, I, H)
        up = np.stack([hf[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(4)])
        down = np.stack([hf[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(4)])  # (E, H, I)
        if fmt == "mindformers-mcore":
            w1 = mf["decoder.layers.1.mlp.experts.weight1"]
            assert w1.shape == (4 * 64, 2 * 32)
            w1 = w1.reshape(4, 64, 64).transpose(0, 2, 1)
            assert np.array_equal(w1[:, :32], gate) and np.array_equal(w1[:, 32:], up)
            assert np.array_equal(mf["decoder.layers.1.mlp.experts.weight2"].reshape(4, 32, 64), down.transpose(0, 2, 1))
        else:
            ffn = "model.layers.1.feed_forward.routed_experts.ffn"
            assert np.array_equal(mf[f"{ffn}.w1.weight"], gate.transpose(0, 2, 1))
            assert np.array_equal(mf[f"{ffn}.w3.weight"], up.transpose(0, 2, 1))
            assert np.array_equal(mf[f"{ffn}.w2.weight"], down.transpose(0, 2, 1))
            assert np.array_equal(mf["model.layers.1.feed_forward.shared_experts_gate.weight"],
                                  hf["model.layers.1.mlp.shared_expert_gate.weight"])
    with pytest.raises(ValueError, match="no qwen3_moe model in the 'mindformers' naming; use 'mindformers-mcore'"):
        convert(fixture_path("qwen3_moe_tiny", "base"), str(tmp_path / "x.ckpt"), "hf", "mindformers")
    assert not (tmp_path / "x.ckpt").exists()


def test_stacked_experts_of_another_count_and_a_partial_load_are_handled(tmp_path):
    """A stacked tensor holding other than num_experts experts names itself; strict=False on a
    folder missing one expert's tensor loads every other expert and reports the missing key."""
    import shutil
    from mindqwen.io.experts import unstack_experts
    from mindqwen.io.hf import load_weights
    from mindqwen.io.safetensors import LazyTensor, SafetensorsFile, save_file
    eight = {"model.layers.1.mlp.experts.up_proj.weight": LazyTensor((8, 32, 64), np.dtype(np.float32), None)}
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts.up_proj.weight has shape \[8, 32, 64\]: not 4"):
        unstack_experts(eight, "stacked", 4)

    src = fixture_path("qwen3_moe_tiny", "base")
    f = SafetensorsFile(os.path.join(src, "model.safetensors"))
    gone = "model.layers.1.mlp.experts.2.up_proj.weight"
    os.makedirs(tmp_path / "partial")
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "partial")
    save_file({k: f.get(k) for k in f.keys() if k != gone}, str(tmp_path / "partial" / "model.safetensors"))
    model = QwenForCausalLM(QwenConfig.from_hf(src))
    before = model_state(model)[gone].load().copy()
    missing, unexpected = load_weights(model, str(tmp_path / "partial"), strict=False)
    assert (missing, unexpected) == ([gone], [])
    state = model_state(model)
    assert np.array_equal(state[gone].load(), before)  # left as it was
    for e in (0, 1, 3):
        key = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
        assert np.array_equal(state[key].load(), f.get(key))


def test_amp_reaches_lora_on_experts():
    from mindqwen import LoraConfig, apply_lora
    from mindqwen.lora import ExpertLoRALayer
    from mindqwen.train.precision import PrecisionConfig, apply_precision
    model = apply_lora(base("qwen3_moe_tiny"), LoraConfig(target_modules=["q_proj", "up_proj"]))
    apply_precision(model, PrecisionConfig(level="O1", dtype="float16"))
    experts = [c for _, c in model.cells_and_names() if isinstance(c, ExpertLoRALayer)]
    assert experts and all(c.compute_dtype == ms.float16 for c in experts)
    assert np.isfinite(model(ids_of("qwen3_moe_tiny")).asnumpy()).all()


# ------------------------------------------------------------------------------ LoRA on experts
def test_lora_on_experts_has_peft_names_and_the_router_is_frozen_unless_saved(tmp_path):
    from mindqwen import LoraConfig, apply_lora, save_adapter
    from mindqwen.io.safetensors import SafetensorsFile
    with pytest.raises(ValueError, match="expert router model.layers.0.mlp.gate, which takes no LoRA"):
        apply_lora(base("qwen3_moe_tiny"), LoraConfig(target_modules=["q_proj", "gate"]))

    model = apply_lora(base("qwen3_moe_tiny"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"],
                                                          init_lora_weights="gaussian"))
    trainable = {p.name: p.size for p in model.trainable_params()}
    # per layer: q_proj (64 → 128) and 4 experts' up_proj (64 → 32), r = 4
    assert sum(trainable.values()) == 2 * (4 * (64 + 128) + 4 * 4 * (64 + 32))
    lora_b = {p.name: p.shape for p in model.trainable_params()}["model.layers.1.mlp.experts.up_proj.lora_b"]
    assert lora_b == (4, 32, 4)  # the 4 experts' B stacked
    assert not any(".mlp.gate." in n for n in trainable)
    for p in model.trainable_params():  # B = 0 leaves the output unchanged: make the adapter do something
        p.set_data(Tensor(np.random.default_rng(1).standard_normal(p.shape).astype(np.float32) * 0.1))
    save_adapter(model, str(tmp_path / "adapter"))
    keys = SafetensorsFile(str(tmp_path / "adapter" / "adapter_model.safetensors")).keys()
    assert "base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_A.weight" in keys
    ids = ids_of("qwen3_moe_tiny")
    reloaded = load_adapter(base("qwen3_moe_tiny"), str(tmp_path / "adapter"))
    assert np.array_equal(reloaded(ids).asnumpy(), model(ids).asnumpy())
    assert np.abs(merge_and_unload(reloaded)(ids).asnumpy() - model(ids).asnumpy()).max() <= 1e-5
    # PEFT's per-expert merge, W + (alpha/r)·B·A from the adapter file, is the merged model's expert 3.
    adapter = SafetensorsFile(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.mlp.experts.3.up_proj"
    base_w = SafetensorsFile(fixture_path("qwen3_moe_tiny", "base", "model.safetensors")).get(
        "model.layers.1.mlp.experts.3.up_proj.weight").astype(np.float64)
    expected = base_w + 2.0 * adapter.get(prefix + ".lora_B.weight").astype(np.float64) @ adapter.get(prefix + ".lora_A.weight")
    reloaded.save_pretrained(str(tmp_path / "merged"))
    merged_w = SafetensorsFile(str(tmp_path / "merged" / "model.safetensors")).get("model.layers.1.mlp.experts.3.up_proj.weight")
    assert np.abs(merged_w - expected).max() <= 1e-6
    # Training with a capacity that holds every assignment (C = N) runs the per-expert batches
    # through the adapters (the other path): the same logits.
    capped = load_adapter(from_pretrained(fixture_path("qwen3_moe_tiny", "base"), moe_capacity_factor=2.0),
                          str(tmp_path / "adapter"))
    capped.set_train(True)
    assert rel(capped(ids).asnumpy(), model(ids).asnumpy()) <= 1e-5

    trained_router = apply_lora(base("qwen3_moe_tiny"), LoraConfig(target_modules=["q_proj"], modules_to_save=["gate"]))
    assert {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"} <= {
        p.name for p in trained_router.trainable_params()}


def test_export_runs_hfs_greedy_tokens_in_a_process_without_mindqwen(tmp_path):
    """MindIR prefill/decode of a mixture of experts, through the export's runner: HF's greedy tokens."""
    import json
    import os

    from mindqwen.export import export_model
    from test_export import _run_exported
    ref = reference("qwen3_moe_tiny")
    folder = str(tmp_path / "export")
    export_model(base("qwen3_moe_tiny"), folder, max_seq_len=32, seq_buckets=[16])
    with open(os.path.join(folder, "parity.json")) as f:
        parity = json.load(f)
    assert parity["passed"] and parity["eager_same_steps"]["max_abs_logit_diff"] <= 1e-5
    gen = ref["gen_ids"]
    out = _run_exported(folder, "--prompt-ids", ",".join(map(str, gen[0, :16])), "--max-new-tokens", "8")
    assert out[0]["tokens"] == gen[0, 16:].tolist()


# ------------------------------------------------------------------------------ capacity
class TrainingLoss(nn.Cell):
    def __init__(self, model):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, ids):
        return self.model.loss_and_aux_loss(ids, None, ids)


def assignment_counts(router_logits, k):
    """(L, N, E) router logits → (L, E): how many tokens pick each expert (numpy)."""
    chosen = np.argsort(-router_logits, -1)[..., :k]
    return np.stack([np.bincount(c.ravel(), minlength=router_logits.shape[-1]) for c in chosen])


@pytest.mark.parametrize("name", MOE_MODELS)
def test_a_capacity_that_holds_every_assignment_trains_as_hf_and_peft(name):
    """moe_capacity_factor just large enough for the busiest expert of the reference batch (HF's
    router logits: 32 tokens × 2 picks, up to 26 on one expert), below the batch: the gathered path
    runs, and the training loss with aux and the LoRA gradients equal HF's and PEFT's."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ref, ids = reference(name), ids_of(name)
    n, load = ids.size, int(assignment_counts(ref["router_logits"], 2).max())
    assert load < n
    factor = load / (n * 2 / 4)  # C = ceil(factor · N · k / E) = load
    model = from_pretrained(fixture_path(name, "base"), moe_capacity_factor=factor)
    model.set_train(True)
    loss, aux, dropped = TrainingLoss(model)(ids)
    assert abs(float(loss.asnumpy()) / float(ref["loss_with_aux"]) - 1) <= TOL
    assert abs(float(aux.asnumpy()) / float(ref["aux_loss"]) - 1) <= TOL and float(dropped.asnumpy()) == 0
    # The adapter moves the hidden states, and with them the routing: its own busiest expert.
    exact = load_adapter(base(name, aux_loss=False), fixture_path(name, "lora_adapter"))
    load = int(assignment_counts(np.stack([r.asnumpy() for r in exact.model.run(ids)[2]]), 2).max())
    assert load < n
    lora = from_pretrained(fixture_path(name, "base"), moe_capacity_factor=load / (n * 2 / 4))
    lora.aux_loss_coef = 0.0
    lora = load_adapter(lora, fixture_path(name, "lora_adapter"))
    lora.set_train(True)
    loss, grads = grads_by_peft_key(lora, ids)
    assert abs(loss - float(ref["loss_lora"])) <= TOL * float(ref["loss_lora"])
    worst = max(rel(g, ref[f"grad/{k}"]) for k, g in grads.items())
    print(f"{name} capacity {load} of {n}: LoRA worst relative gradient error vs PEFT {worst:.2e}")
    assert worst <= GRAD_RTOL


@pytest.mark.parametrize("multiple, capacity", [(1, 8), (3, 9)])
def test_capacity_keeps_each_experts_heaviest_tokens_and_reports_the_dropped_share(multiple, capacity):
    """One MoE block against numpy: expert e runs on its C = ceil(f·N·k/E) tokens of largest
    routing weight (rounded up to a multiple of the devices splitting them, under expert
    parallel); an assignment beyond is dropped (its weight counts for nothing); the dropped
    share is Σ_e max(count_e − C, 0) / (N·k). In eval the block is exact again."""
    from mindqwen.models.moe import SparseMoeBlock, dropped_share
    cfg = QwenConfig(model_type="qwen3_moe", vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=8, norm_topk_prob=True, moe_capacity_factor=0.75)
    rng = np.random.default_rng(0)
    block = SparseMoeBlock(cfg)
    for p in block.get_parameters():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    w = {p.name: p.asnumpy().astype(np.float64) for p in block.get_parameters()}
    x = rng.normal(0, 1, (2, 10, 16)).astype(np.float32)
    n, k, e_count = 20, 2, 4  # ceil(0.75 · 20 · 2 / 4) = 8; as a multiple of 3: 9
    block.capacity_multiple = multiple

    x2 = x.reshape(n, 16).astype(np.float64)
    logits = x2 @ w["gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, -1)[:, :k]
    weights = np.zeros((n, e_count))
    np.put_along_axis(weights, chosen, np.take_along_axis(probs, chosen, 1), 1)
    weights /= weights.sum(-1, keepdims=True)

    def expert(e, rows):  # the stacked weights' slice e: expert e's [out, in]
        g, u = rows @ w["experts.gate_proj.weight"][e].T, rows @ w["experts.up_proj.weight"][e].T
        return (g / (1 + np.exp(-g)) * u) @ w["experts.down_proj.weight"][e].T

    exact, capped = np.zeros_like(x2), np.zeros_like(x2)
    for e in range(e_count):
        exact += weights[:, e:e + 1] * expert(e, x2)
        kept = np.argsort(-weights[:, e])[:capacity]
        capped[kept] += weights[kept, e:e + 1] * expert(e, x2[kept])
    counts = np.bincount(chosen.ravel(), minlength=e_count)
    assert counts.max() > capacity  # some assignments are dropped

    block.set_train(True)
    y, router_logits = block(Tensor(x))
    np.testing.assert_allclose(y.asnumpy().reshape(n, 16), capped, atol=1e-5)
    share = float(dropped_share((router_logits,), k, 0.75, multiple).asnumpy())
    assert share == pytest.approx(np.maximum(counts - capacity, 0).sum() / (n * k), abs=1e-7)
    block.set_train(False)
    np.testing.assert_allclose(block(Tensor(x))[0].asnumpy().reshape(n, 16), exact, atol=1e-5)


def test_fit_logs_the_share_that_the_capacity_dropped(tmp_path):
    """The first logged step's moe_dropped equals the count from the initial router logits (one
    batch holds all the data, so the order of its rows does not matter)."""
    import json

    from mindqwen import TokenDataset, TrainerConfig, fit
    model = tiny_moe(num_experts=4, num_experts_per_tok=2, moe_capacity_factor=1.0)
    data = np.random.default_rng(0).integers(0, 64, (8, 12))
    logits = np.stack([r.asnumpy() for r in model.model.run(Tensor(data.astype(np.int32)))[2]])  # (L, N, E)
    counts = assignment_counts(logits, 2)
    expected = np.maximum(counts - 8 * 12 * 2 // 4, 0).sum() / (2 * 8 * 12 * 2)
    assert expected > 0
    summary = fit(model, TokenDataset(data), TrainerConfig(max_steps=2, micro_batch_size=8, lr=1e-3, warmup_steps=0,
                                                           output_dir=str(tmp_path), progress=False))
    rows = [json.loads(line) for line in open(summary["metrics"])]
    assert rows[0]["moe_dropped"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        QwenConfig(moe_capacity_factor=1.0)
    with pytest.raises(ConfigError, match="moe_capacity_factor"):
        QwenConfig(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8, moe_capacity_factor=0)
