"""Whole training runs against the reference stack: per-step losses, gradient norms, learning rates
and final weights of ``fit`` equal torch + transformers + PEFT's over 20+ steps (goldens made by
fixtures/trajectory/make_trajectory_golden.py: AdamW, warm-up schedules, clipping, decay groups,
token-weighted accumulation)."""
import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from conftest import fixture_path
from mindqwen import from_pretrained, load_adapter
from mindqwen.data.loader import TokenDataset
from mindqwen.lora import adapter_state
from mindqwen.train.config import TrainerConfig
from mindqwen.train.loop import fit
from mindqwen.train.optim import AdamW, WarmupSchedule
from mindqwen.train.precision import PrecisionConfig

GOLDEN = np.load(fixture_path("trajectory", "trajectory.npz"))
with open(fixture_path("trajectory", "trajectory.json")) as _f:
    CASES = json.load(_f)["cases"]
PEFT_PREFIX = "base_model.model."


def read_metrics(folder: str) -> dict:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {k: np.array([r[k] for r in records]) for k in ("loss", "grad_norm", "lr")}


def relative_weight_error(got: np.ndarray, ref: np.ndarray) -> float:
    """‖Δ‖ over the tensor's scale ‖w‖ (Frobenius norms)."""
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def max_weight_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |Δ| over the tensor's largest magnitude."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "fp16" not in c])
def test_a_run_equals_the_reference_stacks_step_by_step(name, tmp_path):
    case = CASES[name]
    ms.set_context(mode=ms.GRAPH_MODE)
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    if case["lora"]:
        load_adapter(model, fixture_path("trajectory", f"{name}_init_adapter"))
    data = TokenDataset(GOLDEN[f"{name}/input_ids"], GOLDEN[f"{name}/labels"])
    config = TrainerConfig(max_steps=case["steps"], micro_batch_size=case["micro_batch_size"],
                           gradient_accumulation=case["gradient_accumulation"], lr=case["lr"],
                           schedule=case["schedule"], warmup_steps=case["warmup_steps"],
                           weight_decay=case["weight_decay"], clip_norm=case["clip_norm"], shuffle=False,
                           output_dir=str(tmp_path), progress=False)
    fit(model, data, config)
    got = read_metrics(str(tmp_path))
    ref = {"loss": GOLDEN[f"{name}/losses"], "grad_norm": GOLDEN[f"{name}/grad_norms"], "lr": GOLDEN[f"{name}/lrs"]}
    assert ref["grad_norm"].max() > case["clip_norm"]  # the clip acts in this run
    assert ref["loss"][-1] < ref["loss"][0] - 0.2  # and the run learns
    errors = {k: float(np.max(np.abs(got[k] / ref[k] - 1))) for k in ("loss", "grad_norm")}
    errors["lr"] = float(np.max(np.abs(got["lr"] - ref["lr"])) / case["lr"])
    if case["lora"]:
        weights = {k[len(PEFT_PREFIX):]: v for k, v in adapter_state(model).items()}
    else:
        weights = {p.name: p.asnumpy() for p in model.trainable_params()}
    final = {k[len(f"{name}/final/"):]: GOLDEN[k] for k in GOLDEN.files if k.startswith(f"{name}/final/")}
    assert sorted(weights) == sorted(final)
    # The key bias is left out: it adds q·b to every score of a query, which the softmax ignores, so
    # its gradient is 0 in exact arithmetic and each stack's update of it is Adam-normalised rounding.
    per_tensor = {k: relative_weight_error(weights[k], final[k]) for k in final if not k.endswith("k_proj.bias")}
    errors["weights"] = max(per_tensor.values())
    errors["weights_max_abs"] = max(max_weight_error(weights[k], final[k]) for k in per_tensor)
    print(f"{name}: {case['steps']} steps, worst relative error {errors}")
    assert errors["loss"] <= 1e-4 and errors["grad_norm"] <= 1e-4 and errors["lr"] <= 1e-6
    assert errors["weights"] <= 1e-4


def test_adamw_moves_a_parameter_by_the_bias_corrected_step():
    """The closed form: a constant gradient g on a parameter makes m̂ = g and v̂ = g², so each
    step moves it by lr·g/(|g| + ε) = lr (ε negligible): −0.1, −0.2, −0.3 at lr 0.1; weight decay λ
    first multiplies it by (1 − lr·λ)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    p = Parameter(Tensor(np.array([0.0, 2.0], np.float32)), name="w.weight")
    opt = AdamW([p], WarmupSchedule("constant", 0.1, 10), weight_decay=0.5)

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.opt = opt

        def construct(self, g):
            return self.opt((g,))

    step = Step()
    expected = np.array([0.0, 2.0])
    for _ in range(3):
        step(Tensor(np.array([1.0, 1.0], np.float32)))
        expected = expected * (1 - 0.1 * 0.5) - 0.1
        assert np.abs(p.asnumpy() - expected).max() <= 1e-6, (p.asnumpy(), expected)


def test_an_fp16_run_skips_and_rescales_as_the_reference_stack(tmp_path):
    """fp16 matmuls (O2) with dynamic loss scaling against torch autocast + GradScaler: the same
    steps overflow and are skipped (the schedule waits), the scale halves and grows at the same
    steps, and the losses agree to fp16 rounding (the two stacks round different tensors)."""
    name, case = "fp16", CASES["fp16"]
    ms.set_context(mode=ms.GRAPH_MODE)
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    load_adapter(model, fixture_path("trajectory", f"{name}_init_adapter"))
    data = TokenDataset(GOLDEN[f"{name}/input_ids"], GOLDEN[f"{name}/labels"])
    precision = PrecisionConfig(level="O2", dtype="float16", loss_scale=case["fp16"]["loss_scale"],
                                scale_window=case["fp16"]["scale_window"])
    config = TrainerConfig(max_steps=case["steps"], micro_batch_size=case["micro_batch_size"], lr=case["lr"],
                           schedule=case["schedule"], warmup_steps=case["warmup_steps"],
                           weight_decay=case["weight_decay"], clip_norm=case["clip_norm"], precision=precision,
                           shuffle=False, output_dir=str(tmp_path), progress=False)
    fit(model, data, config)
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    skipped = [r["overflow"] for r in records]
    scales = [r["loss_scale"] for r in records]
    losses = np.array([r["loss"] for r in records])
    assert GOLDEN[f"{name}/skipped"].sum() >= 2
    ref_losses = GOLDEN[f"{name}/losses"]
    weights = {k[len(PEFT_PREFIX):]: v for k, v in adapter_state(model).items()}
    final = {k[len(f"{name}/final/"):]: GOLDEN[k] for k in GOLDEN.files if k.startswith(f"{name}/final/")}
    weight_error = max(relative_weight_error(weights[k], final[k]) for k in final)
    print(f"fp16: skipped {np.flatnonzero(skipped).tolist()} (reference {np.flatnonzero(GOLDEN[f'{name}/skipped']).tolist()}), "
          f"loss worst relative {np.max(np.abs(losses / ref_losses - 1)):.2e}, weights {weight_error:.2e}")
    assert skipped == GOLDEN[f"{name}/skipped"].tolist()
    assert scales == GOLDEN[f"{name}/loss_scales"].tolist()
    # fp16 keeps 11 bits: losses within two units of its rounding (4.9e-4 each; measured 1.3e-4),
    # weights within 1% (measured 5.1e-3: Adam normalises gradients whose low bits differ)
    assert np.max(np.abs(losses / ref_losses - 1)) <= 1e-3
    assert weight_error <= 1e-2


DPO = np.load(fixture_path("trajectory", "dpo_trajectory.npz"))
with open(fixture_path("trajectory", "dpo_trajectory.json")) as _f:
    DPO_SETTINGS = json.load(_f)["settings"]


def test_a_dpo_run_equals_trls_dpo_trainer_step_by_step(tmp_path):
    """Sigmoid DPO (β 0.1) on LoRA, the reference the adapters off, at a constant learning rate:
    ``fit(model, pairs)``'s per-step loss, gradient norm, reward accuracy and margin and its final
    adapter equal TRL's ``DPOTrainer.train()`` (fixtures/trajectory/make_dpo_trajectory_golden.py),
    and the run learns (where the optimizer without bias correction collapsed at a constant rate)."""
    from mindqwen.preference import PreferenceConfig
    s = DPO_SETTINGS
    assert (PreferenceConfig().loss_type, PreferenceConfig().beta) == (s["loss_type"], s["beta"])  # fit's default
    ms.set_context(mode=ms.GRAPH_MODE)
    model = load_adapter(from_pretrained(fixture_path("qwen2_tiny", "base")), fixture_path("trajectory", "dpo_init_adapter"))
    config = TrainerConfig(max_steps=s["steps"], micro_batch_size=s["batch_size"], lr=s["lr"], schedule=s["schedule"],
                           weight_decay=s["weight_decay"], clip_norm=s["max_grad_norm"], shuffle=False,
                           output_dir=str(tmp_path), progress=False)
    fit(model, TokenDataset(DPO["input_ids"], DPO["labels"]), config)  # (N, 2, S) pairs: sigmoid DPO, adapters off
    with open(os.path.join(str(tmp_path), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    got = {k: np.array([r[k] for r in records]) for k in ("loss", "grad_norm", "lr", "rewards/accuracies",
                                                         "rewards/margins")}
    ref = {k: DPO[k] for k in ("loss", "grad_norm", "rewards/accuracies", "rewards/margins")}
    errors = {k: float(np.max(np.abs(got[k] / ref[k] - 1))) for k in ("loss", "grad_norm")}
    errors["lr"] = float(np.max(np.abs(got["lr"] - DPO["learning_rate"])) / s["lr"])
    errors["margins"] = float(np.max(np.abs(got["rewards/margins"] - ref["rewards/margins"]))
                              / np.abs(ref["rewards/margins"]).max())
    weights = {k[len(PEFT_PREFIX):]: v for k, v in adapter_state(model).items()}
    final = {k[len("final/"):]: DPO[k] for k in DPO.files if k.startswith("final/")}
    assert sorted(weights) == sorted(final)
    errors["weights"] = max(relative_weight_error(weights[k], final[k]) for k in final)
    errors["weights_max_abs"] = max(max_weight_error(weights[k], final[k]) for k in final)
    print(f"dpo: {s['steps']} steps at lr {s['lr']}, loss {got['loss'][0]:.4f} -> {got['loss'][-1]:.4f}, reward "
          f"accuracy {got['rewards/accuracies'][:4].mean():.2f} -> {got['rewards/accuracies'][-4:].mean():.2f}; "
          f"worst relative error {errors}")
    assert ref["grad_norm"].max() > s["max_grad_norm"]  # the clip acts in this run
    assert errors["loss"] <= 1e-4 and errors["grad_norm"] <= 1e-4 and errors["lr"] <= 1e-6
    assert errors["margins"] <= 1e-4 and errors["weights"] <= 1e-4
    np.testing.assert_array_equal(got["rewards/accuracies"], ref["rewards/accuracies"])
    # it learns: from ln 2 (B = 0) well below it, preferring every chosen response by the end
    assert got["loss"][0] == pytest.approx(np.log(2), abs=1e-6) and got["loss"][-4:].max() < np.log(2) / 4
    assert got["rewards/accuracies"][:4].mean() < 0.75 and got["rewards/accuracies"][-4:].min() == 1.0
