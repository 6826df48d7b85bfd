"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, dense and mixture-of-experts) and Qwen3-Next against HF
transformers 5.25 (fixtures/qwen3_5, made by make_qwen3_5_golden.py): loading the text and the vision-language folders, the
config's round trip, logits over 150 tokens (three delta-rule chunks), a left-padded row, the loss, and the
gradients of every kind of parameter, in GRAPH_MODE.

Errors are max|Δ| / max|ref|. HF's own fp32 logits are 4.5e-6 (dense) and 1e-5 (MoE) off its float64 ones;
ours stay within 1e-5 (dense) and 2e-5 (MoE: the router's softmax and the experts' gates add fp32 rounding that
HF's order of sums does not share; 1.8e-5 measured).
"""
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor
from safetensors import safe_open

from conftest import fixture_path
from mindqwen.config import QwenConfig
from mindqwen.generation import GenerationConfig, Generator, generate
from mindqwen.io.linear_attention import fuse_projections
from mindqwen.io.safetensors import LazyTensor
from mindqwen.models.qwen import QwenForCausalLM

LOGIT_TOL = {"qwen3_5_tiny": 1e-5, "qwen3_5_moe_tiny": 2e-5, "qwen3_next_tiny": 2e-5}
GRAD_TOL = 1e-4  # HF's own fp32 gradients are up to 1.9e-5 off float64 (README of the fixtures)


@pytest.fixture(autouse=True)
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)


def rel(actual, ref) -> float:
    return float(np.abs(actual - ref).max() / np.abs(ref).max())


def load(name: str):
    folder = fixture_path("qwen3_5", name)
    return QwenForCausalLM.from_pretrained(folder), dict(np.load(os.path.join(folder, "golden.npz")))


def ids(array) -> Tensor:
    return Tensor(array.astype(np.int32))


def test_config_reads_the_hybrid_layout():
    cfg = QwenConfig.from_hf(fixture_path("qwen3_5", "qwen3_5_tiny"))
    assert cfg.model_type == "qwen3_5" and cfg.is_hybrid
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.rotary_dim, cfg.qk_norm, cfg.qkv_bias) == (8, True, False)
    assert QwenConfig.from_hf(cfg.to_hf()) == cfg
    vl = QwenConfig.from_hf(fixture_path("qwen3_5", "qwen3_5_vl_tiny"))  # text_config of the published layout
    assert vl == cfg
    moe = QwenConfig.from_hf(fixture_path("qwen3_5", "qwen3_5_moe_tiny"))
    assert (moe.model_type, moe.num_experts, moe.norm_topk_prob, moe.shared_expert_intermediate_size) == \
        ("qwen3_5_moe", 4, True, 32)
    # The config's tensor layout is the HF folder's, and the model's parameters.
    with safe_open(fixture_path("qwen3_5", "qwen3_5_tiny", "model.safetensors"), "np") as f:
        on_disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert cfg.tensor_shapes() == on_disk
    model, _ = load("qwen3_5_tiny")
    assert {name: tuple(p.shape) for name, p in model.parameters_and_names()} == on_disk


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_moe_tiny", "qwen3_next_tiny"])
def test_logits_and_loss_equal_hf(name):
    model, g = load(name)
    err = rel(model(ids(g["input_ids"])).asnumpy(), g["logits"])
    print(f"{name}: logits {err:.1e}")
    assert err <= LOGIT_TOL[name]
    padded = model(ids(g["input_ids_padded"]), ids(g["attention_mask_padded"])).asnumpy()
    pad = int((g["attention_mask_padded"][1] == 0).sum())
    err = rel(padded[1, pad:], g["logits_padded_row1"])
    print(f"{name}: left-padded row {err:.1e}")
    assert err <= 3 * LOGIT_TOL[name]
    loss = float(model(ids(g["input_ids"]), labels=ids(g["input_ids"])).asnumpy())
    expected = float(g["loss_with_aux"] if "loss_with_aux" in g else g["loss"])  # a mixture adds HF's aux loss
    assert abs(loss - expected) <= 1e-5 * abs(expected)


def test_vision_language_folder_loads_its_language_model(capsys):
    folder = fixture_path("qwen3_5", "qwen3_5_vl_tiny")
    model = QwenForCausalLM.from_pretrained(folder)
    assert "loading the language model only" in capsys.readouterr().out
    g = dict(np.load(fixture_path("qwen3_5", "qwen3_5_tiny", "golden.npz")))
    assert rel(model(ids(g["input_ids"])).asnumpy(), g["logits"]) <= LOGIT_TOL["qwen3_5_tiny"]


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_moe_tiny", "qwen3_next_tiny"])
def test_gradients_equal_hf(name):
    model, g = load(name)
    model.aux_loss_coef = 0.0  # the golden differentiates the cross-entropy alone
    params = list(model.trainable_params())
    x = ids(g["input_ids"])
    grads = ms.value_and_grad(model, None, params)(x, None, x)[1]  # labels = the input, as HF's golden
    by_name = {p.name: grad.asnumpy() for p, grad in zip(params, grads)}
    # Qwen3-Next's golden has the checkpoint's fused projections: the model's four gradients, fused alike
    fused = fuse_projections({k: LazyTensor(v.shape, v.dtype, lambda v=v: v) for k, v in by_name.items()},
                             model.config)
    by_name = {k: t.load() for k, t in fused.items()}
    worst = {}
    for key in (k for k in g if k.startswith("grad/")):
        name_ = key[len("grad/"):]
        if ".experts." in name_:  # stored per expert; the model stacks them [E, out, in]
            head, expert, proj = name_.rsplit(".", 3)[0], int(name_.split(".")[-3]), name_.split(".")[-2]
            ours = by_name[f"{head}.{proj}.weight"][expert]
        else:
            ours = by_name[name_]
        worst[name_] = rel(ours, g[key])
    print(name, {k: f"{v:.1e}" for k, v in worst.items()})
    assert max(worst.values()) <= GRAD_TOL


def test_what_is_not_built_yet_is_refused_by_name():
    from mindqwen.data.loader import TokenDataset
    from mindqwen.train.config import TrainerConfig
    from mindqwen.train.distributed import ParallelConfig, check_model_layout
    from mindqwen.train.loop import fit
    model, _ = load("qwen3_5_tiny")
    with pytest.raises(ValueError, match="tensor_parallel=2: qwen3_5's linear-attention layers"):
        check_model_layout(model.config, ParallelConfig(tensor_parallel=2))
    rows = np.zeros((2, 8), np.int32)
    packed = TokenDataset(rows, rows, position_ids=np.tile(np.array([0, 1, 2, 0, 1, 2, 3, 0], np.int32), (2, 1)))
    with pytest.raises(ValueError, match="packed samples"):
        fit(model, packed, TrainerConfig(max_steps=1))


@pytest.mark.parametrize("name", ["qwen3_5_tiny", "qwen3_5_moe_tiny", "qwen3_next_tiny"])
def test_greedy_generation_equals_hf(name):
    """20 greedy tokens after a 30-token prompt, and after a left-padded one: HF's with its cache (its
    recurrent and convolution states), which equal its tokens without one."""
    model, g = load(name)
    assert np.array_equal(generate(model, g["gen_prompt"].astype(np.int32), max_new_tokens=20), g["gen_ids"])
    padded = generate(model, g["gen_prompt_padded"].astype(np.int32), max_new_tokens=20,
                      attention_mask=g["gen_attention_mask_padded"].astype(np.int32))
    assert np.array_equal(padded, g["gen_ids_padded"])


def test_rows_joining_a_running_batch_keep_their_own_states():
    """Continuous batching: A decodes, B joins after three steps, C (a shorter prompt) two steps later;
    each row's linear-attention states travel with it, so every row gives HF's tokens for its prompt."""
    model, g = load("qwen3_5_tiny")
    pad = int((g["gen_attention_mask_padded"][1] == 0).sum())
    prompts = {"A": g["gen_prompt"][0].tolist(), "B": g["gen_prompt"][1].tolist(),
               "C": g["gen_prompt_padded"][1, pad:].tolist()}
    expected = {"A": g["gen_ids"][0, 30:].tolist(), "B": g["gen_ids"][1, 30:].tolist(),
                "C": g["gen_ids_padded"][1, 30:].tolist()}
    generator = Generator(model)
    batch, tokens = generator.batch(max_rows=4), {key: [] for key in prompts}

    def join(key):
        batch.join([prompts[key]], [GenerationConfig(max_new_tokens=20)], [key],
                   lambda owner, tok, _text: tokens[owner].append(tok))

    def step():
        batch.step(lambda owner, tok, _text: tokens[owner].append(tok))
    with generator.graph_mode():
        join("A")
        for _ in range(3):
            step()
        join("B")
        step(), step()
        join("C")
        while batch.active:
            step()
    assert tokens == expected

def test_fused_expert_checkpoints_load(tmp_path):
    """Experts kept fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], as the published
    Qwen3.5-MoE folders keep them) load to the same model as HF's per-expert tensors."""
    import shutil
    from safetensors.numpy import load_file, save_file
    source = fixture_path("qwen3_5", "qwen3_5_moe_tiny")
    tensors = load_file(os.path.join(source, "model.safetensors"))
    fused, experts = {}, {}
    for key, value in tensors.items():
        head, sep, rest = key.partition(".mlp.experts.")
        if sep and rest[0].isdigit():
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            experts.setdefault(head, {}).setdefault(proj, {})[e] = value
        else:
            fused[key] = value
    for head, projs in experts.items():
        n = len(projs["gate_proj"])
        fused[f"{head}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        fused[f"{head}.mlp.experts.down_proj"] = np.stack([projs["down_proj"][e] for e in range(n)])
    save_file(fused, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(source, "config.json"), tmp_path / "config.json")
    model, g = load("qwen3_5_moe_tiny")
    from_fused = QwenForCausalLM.from_pretrained(str(tmp_path))
    assert all(np.array_equal(a.asnumpy(), b.asnumpy()) for a, b in zip(model.get_parameters(), from_fused.get_parameters()))


def test_qwen3_next_saves_its_fused_projections_as_it_loads_them(tmp_path):
    """Qwen3-Next's checkpoint fuses the linear-attention input projections (in_proj_qkvz, in_proj_ba); the
    model unfuses them on load and fuses them back on save, tensor for tensor. Its hub-style config (top-level
    rope fields, full_attention_interval without layer_types) reads to the same model."""
    from mindqwen.lora import LoraConfig, apply_lora, save_adapter
    folder = fixture_path("qwen3_5", "qwen3_next_tiny")
    model, g = load("qwen3_next_tiny")
    model.save_pretrained(str(tmp_path / "saved"))
    with safe_open(os.path.join(folder, "model.safetensors"), "np") as a, \
            safe_open(str(tmp_path / "saved" / "model.safetensors"), "np") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(np.array_equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    assert QwenConfig.from_hf(os.path.join(folder, "config_hf4_style.json")) == model.config
    assert QwenConfig.from_hf(str(tmp_path / "saved")) == model.config
    lora = apply_lora(model, LoraConfig(r=2, target_modules=["in_proj_qkv", "q_proj"]))
    with pytest.raises(ValueError, match="in_proj_qkv: a Qwen3-Next adapter on the linear-attention input"):
        save_adapter(lora, str(tmp_path / "adapter"))
    assert not os.path.exists(tmp_path / "adapter")
