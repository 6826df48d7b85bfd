"""The GRPO family against TRL 1.16's GRPOTrainer (fixtures/grpo, made by make_trl_golden.py from TRL's own
trainer code): the loss and its metrics for every loss_type, β 0 and 0.04, GSPO, δ, the KL without its
importance correction, accumulation, on-policy batches, on TRL's per-token log-probs; the loss and every LoRA
gradient through the policy's own log-probs (qwen2_tiny + its adapter); the advantages and reward metrics for
every scale_rewards; the completion metrics. Reward functions: loading, columns, None, and each way a
function can fail, named in one line."""
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


@pytest.mark.parametrize("name", ["grpo_beta0.04", "dr_grpo_beta0", "dapo_ga2", "gspo_beta0.04", "grpo_delta1.3",
                                  "on_policy_grpo_beta0.04"])
def test_lora_gradients_equal_trl(name):
    """The policy's own log-probs (the LoRA model over [left-padded prompt | completion]) through the loss:
    the loss and every LoRA gradient equal TRL's (its backward through PEFT), in GRAPH_MODE."""
    from mindqwen import from_pretrained, load_adapter
    from mindqwen.rl import GRPOLoss
    ms.set_context(mode=ms.GRAPH_MODE)
    case, d = META["cases"][name], "loss/data/"
    model = load_adapter(from_pretrained(os.path.join(FIXTURES, "qwen2_tiny", "base")),
                         os.path.join(FIXTURES, "qwen2_tiny", "lora_adapter"))
    model.set_train(True)
    loss_net = GRPOLoss(model, config_of(case))
    ids = np.concatenate([Z[d + "prompt_ids"], Z[d + "completion_ids"]], 1).astype(np.int32)
    mask = np.concatenate([Z[d + "prompt_mask"], Z[d + "completion_mask"]], 1).astype(np.int32)
    num_items = Z[d + "num_items_in_batch"] + (19 if name == "dapo_ga2" else 0)
    on_policy = name.startswith("on_policy")
    params = model.trainable_params()
    step = ms.value_and_grad(loss_net, None, params, has_aux=True)  # the loss; the metrics ride along
    (loss, *_), grads = step(Tensor(ids), Tensor(mask), Tensor(Z[d + "completion_mask"]), Tensor(Z[d + "advantages"]),
                             None if on_policy else Tensor(Z[d + "old_per_token_logps"]),
                             Tensor(Z[d + "ref_per_token_logps"]), Tensor(np.float32(num_items)),
                             case.get("gradient_accumulation_steps", 1))
    ref = float(Z[f"loss/{name}/loss"])
    worst = 0.0
    for p, g in zip(params, grads):
        key = f"loss/{name}/grad/base_model.model." + p.name.replace(".lora_a", ".lora_A.weight").replace(
            ".lora_b", ".lora_B.weight")
        golden = Z[key]
        worst = max(worst, float(np.abs(g.asnumpy() - golden).max() / np.abs(golden).max()))
    print(f"{name}: loss {float(loss.asnumpy()):.7f} TRL {ref:.7f}, worst LoRA gradient {worst:.1e}")
    assert abs(float(loss.asnumpy()) - ref) <= 1e-5 * max(1.0, abs(ref))
    assert worst <= 1e-4


def _rewards_file(tmp_path):
    path = tmp_path / "rewards.py"
    path.write_text(
        "import time\n"
        "def length(completions, prompts=None, **kw):\n    return [float(len(c)) for c in completions]\n"
        "def answer(completions, prompts=None, answer=None, **kw):\n"
        "    return [None if a is None else float(c.strip() == a) for c, a in zip(completions, answer)]\n"
        "def boom(completions, **kw):\n    raise KeyError('answer')\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def nan(completions, **kw):\n    return [0.0, float('nan')]\n"
        "def slow(completions, **kw):\n    time.sleep(30)\n")
    return path


def test_reward_functions_load_and_score_with_columns_and_nones(tmp_path):
    from mindqwen.rl import load_reward_funcs, score
    _rewards_file(tmp_path)
    funcs = load_reward_funcs(["rewards.py:length", "rewards.py:answer", "json:dumps"], base=str(tmp_path))
    assert [name for name, _ in funcs] == ["length", "answer", "dumps"]
    got = score(funcs[:2], [" 4", "5"], ["2+2=", "2+3="], {"answer": ["4", None]})
    np.testing.assert_array_equal(got, np.array([[2, 1], [1, np.nan]], np.float32))


@pytest.mark.parametrize("func, message", [
    ("boom", "reward function boom raised KeyError: 'answer' (a batch of 2 completions; the first: 'a')"),
    ("short", "reward function short returned 1 values for 2 completions"),
    ("nan", "reward function nan returned nan for completion 1: 'bb' (a reward is a finite number"),
    ("slow", "reward function slow: no answer within 0.5 s for a batch of 2 completions"),
])
def test_a_bad_reward_function_is_named_with_the_completion(tmp_path, func, message):
    from mindqwen.rl import RewardError, load_reward_funcs, score
    _rewards_file(tmp_path)
    funcs = load_reward_funcs([f"rewards.py:{func}"], base=str(tmp_path))
    with pytest.raises(RewardError) as e:
        score(funcs, ["a", "bb"], ["p", "q"], {}, timeout=0.5)
    assert str(e.value).startswith(message)


def test_a_reward_function_that_cannot_load_is_named(tmp_path):
    from mindqwen.rl import RewardError, load_reward_funcs
    _rewards_file(tmp_path)
    for spec, message in (("missing.py:f", "missing.py not found"), ("rewards.py:nope", "has no function 'nope'"),
                          ("rewards", "expected path/to/file.py:function"),
                          ("no_such_module_x:f", "importing it failed: ModuleNotFoundError")):
        with pytest.raises(RewardError, match=message):
            load_reward_funcs(["rewards.py:length", spec], base=str(tmp_path))


def test_rollouts_are_seeded_per_row_and_their_log_probs_are_the_samplers():
    """G completions per prompt, each row its own sampler: a group's completions differ, the same (seed, step)
    draws the same batch again, another step another. The training graph's log-probs of the sampled tokens
    (GRPOLoss's path: [left-padded prompt | completion]) equal the sampler's own (the KV-cache decode)."""
    from mindqwen import from_pretrained
    from mindqwen.generation import GenerationConfig, Generator
    from mindqwen.rl import rollout
    ms.set_context(mode=ms.GRAPH_MODE)
    model = from_pretrained(os.path.join(FIXTURES, "qwen2_tiny", "base"))
    config = GRPOConfig(reward_funcs=["f"], num_generations=3, max_completion_length=6, temperature=1.0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    a = rollout(model, prompts, config, eos_token_id=3, seed=7, step=0)
    assert a.input_ids.shape == (6, 4 + a.completion_mask.shape[1]) and len(a.completions) == 6
    assert len({tuple(c) for c in a.completions[:3]}) > 1  # a group's completions are not copies
    assert a.completions == rollout(model, prompts, config, eos_token_id=3, seed=7, step=0).completions
    assert a.completions != rollout(model, prompts, config, eos_token_id=3, seed=7, step=1).completions
    np.testing.assert_array_equal(a.attention_mask[4, :2], [0, 0])  # the short prompt, left-padded
    assert all(t == (c[-1] != 3) for t, c in zip(a.truncated, a.completions))
    # the sampler's log-probs of its tokens (the same rows and seeds, recorded), against the training graph's
    rows = [p for p in prompts for _ in range(3)]
    seeds = np.random.SeedSequence([7, 0]).generate_state(6)
    recorded = Generator(model).run(rows, [GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=3,
                                                            pad_token_id=0, seed=int(s), top_logprobs=0)
                                           for s in seeds])
    assert [r.tokens for r in recorded] == a.completions
    t = a.completion_mask.shape[1]
    labels = np.where(np.concatenate([np.zeros_like(a.input_ids[:, :-t]), a.completion_mask], 1) > 0,
                      a.input_ids, -100).astype(np.int32)
    logps = model.token_log_probs(Tensor(a.input_ids), Tensor(labels), False, Tensor(a.attention_mask)).asnumpy()
    for i, r in enumerate(recorded):
        np.testing.assert_allclose(logps[i, -t:][:len(r.tokens)], [lp.logprob for lp in r.logprobs], atol=1e-5)
