"""The GRPO family against TRL 1.16's GRPOTrainer (fixtures/grpo, made by make_trl_golden.py from TRL's own
trainer code): the loss and its metrics for every loss_type, β 0 and 0.04, GSPO, δ, the KL without its
importance correction, accumulation, on-policy batches, on TRL's per-token log-probs; the advantages and
reward metrics for every scale_rewards; the completion metrics."""
import json
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import FIXTURES
from mindqwen.rl import GRPOConfig, advantages, completion_metrics, grpo_loss, reward_func_metrics

GOLDEN = os.path.join(FIXTURES, "grpo")
with open(os.path.join(GOLDEN, "trl_golden.json")) as f:
    META = json.load(f)
Z = dict(np.load(os.path.join(GOLDEN, "trl_golden.npz")))
METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def config_of(case: dict) -> GRPOConfig:
    common = META["common_config"]
    return GRPOConfig(
        reward_funcs=["f"], num_generations=common["num_generations"],
        max_completion_length=common["max_completion_length"], loss_type=case["loss_type"], beta=case["beta"],
        epsilon=common["epsilon"], epsilon_high=case.get("epsilon_high", common["epsilon_high"]),
        delta=case.get("delta"), kl_importance_correction=case.get("use_bias_correction_kl", True),
        importance_sampling_level=case.get("importance_sampling_level", "token"))


@pytest.mark.parametrize("name", sorted(META["cases"]))
def test_loss_and_metrics_equal_trl(name):
    case, d = META["cases"][name], "loss/data/"
    config = config_of(case)
    accumulation = case.get("gradient_accumulation_steps", 1)
    num_items = Z[d + "num_items_in_batch"] + (19 if name == "dapo_ga2" else 0)  # the json's dapo_ga2 note
    on_policy = name.startswith("on_policy")
    logps = Tensor(Z["loss/per_token_logps"])
    out = grpo_loss(config, logps, None if on_policy else Tensor(Z[d + "old_per_token_logps"]),
                    Tensor(Z[d + "ref_per_token_logps"]), Tensor(Z[d + "advantages"]),
                    Tensor(Z[d + "completion_mask"].astype(np.float32)),
                    Tensor(np.float32(num_items)), accumulation)
    loss, *metrics = (float(x.asnumpy()) for x in out)
    ref = float(Z[f"loss/{name}/loss"])
    print(f"{name}: loss {loss:.7f} TRL {ref:.7f}")
    assert abs(loss - ref) <= 1e-6 * max(1.0, abs(ref))
    for key, value in zip(METRICS, metrics):
        golden = Z.get(f"loss/{name}/metrics/{key}")
        if golden is None:  # TRL logs no kl with β = 0
            assert key == "kl" and config.beta == 0 and value == 0
        else:
            assert abs(value - float(golden)) <= 1e-6 * max(1.0, abs(float(golden))), key


def test_every_case_is_checked_and_clips_both_ways():
    assert len(META["cases"]) == 16
    low, high = (float(Z[f"loss/grpo_beta0/metrics/clip_ratio/{k}"]) for k in ("low_mean", "high_mean"))
    assert low > 0 and high > 0  # the golden exercises both sides of the clip


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trl(scale):
    data = META["adv_data"]
    rewards = Z["adv/data/rewards_per_func"]
    adv, metrics = advantages(rewards, np.asarray(data["reward_weights"], np.float32), 4, scale)
    np.testing.assert_allclose(adv, Z[f"adv/{scale}/advantages"], rtol=1e-5, atol=1e-6)
    metrics.update(reward_func_metrics(rewards, data["reward_funcs"]))
    for key, value in metrics.items():
        assert value == pytest.approx(float(Z[f"adv/{scale}/metrics/{key}"]), rel=1e-5, abs=1e-7), key
    assert adv[9] == 0 and np.all(adv[4:8] == 0)  # the unscorable row; the group whose rewards are all equal


def test_completion_metrics_equal_trl():
    completions = META["adv_data"]["completions"]
    lengths = [len(c) for c in completions]
    truncated = [c[-1] != 1 for c in completions]  # EOS is 1 in the golden
    for key, value in completion_metrics(lengths, truncated).items():
        assert value == pytest.approx(float(Z[f"adv/group/metrics/{key}"]), rel=1e-6), key


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="grpo.loss_type must be one of grpo, dr_grpo, dapo, bnpo"):
        GRPOConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="num_generations must be an integer >= 2"):
        GRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="reward_weights has 1 entries for 2 reward_funcs"):
        GRPOConfig(reward_funcs=["a:f", "b:g"], reward_weights=[1.0])
    with pytest.raises(ValueError, match="delta 1.1 must exceed"):
        GRPOConfig(delta=1.1)
