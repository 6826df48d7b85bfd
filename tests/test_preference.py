"""Preference tuning against HF TRL (tests/fixtures/preference: made by make_trl_golden.py with
TRL's DPOTrainer, CPOTrainer and ORPOTrainer on the tiny Qwen2 and its PEFT adapter)."""
import json
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import fixture_path
from mindqwen import from_pretrained, load_adapter
from mindqwen.config import IGNORE_INDEX
from mindqwen.models.graph import in_mode
from mindqwen.preference import (PreferenceConfig, PreferenceLoss, frozen_copy, pair_losses, preference_loss,
                                 reference_view)

GOLDEN = np.load(fixture_path("preference", "trl_golden.npz"))
META = json.load(open(fixture_path("preference", "trl_golden.json"), encoding="utf-8"))
# Each golden case as mindqwen's loss settings.
CASES = {
    "sigmoid": PreferenceConfig("sigmoid", beta=0.1),
    "sigmoid_ls": PreferenceConfig("sigmoid", beta=0.1, label_smoothing=0.1),
    "robust": PreferenceConfig("robust", beta=0.1, label_smoothing=0.1),
    "hinge": PreferenceConfig("hinge", beta=0.1),
    "ipo": PreferenceConfig("ipo", beta=0.1),
    "rpo": PreferenceConfig("sigmoid", beta=0.1, sft_weight=0.5),
    "simpo": PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.5),
    "orpo": PreferenceConfig("orpo", beta=0.1),
}
SEQ = 16  # every prompt + response of the golden pairs fits


def _pairs():
    parts = {}
    for part in ("prompt", "chosen", "rejected"):
        ids, lens = GOLDEN[f"data/{part}_ids"], GOLDEN[f"data/{part}_lens"]
        parts[part] = np.split(ids, np.cumsum(lens)[:-1])
    return list(zip(parts["prompt"], parts["chosen"], parts["rejected"]))


def _batch():
    """(3, 2, SEQ) input_ids and labels: prompt + response, labels on the response only."""
    ids = np.zeros((3, 2, SEQ), np.int32)
    labels = np.full((3, 2, SEQ), IGNORE_INDEX, np.int32)
    for i, (prompt, chosen, rejected) in enumerate(_pairs()):
        for j, response in enumerate((chosen, rejected)):
            row = np.concatenate([prompt, response])
            ids[i, j, :len(row)] = row
            labels[i, j, len(prompt):len(row)] = response
    return ids, labels


def _golden_logps(setting, who):
    return [GOLDEN[f"{setting}/{who}/{side}_logps"] for side in ("chosen", "rejected")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_pair_losses_and_rewards_equal_trl_given_its_log_probs(case):
    """The loss functions alone, on TRL's own per-sequence log-probs."""
    chosen, rejected = (Tensor(x) for x in _golden_logps("lora", "policy"))
    ref_c, ref_r = (Tensor(x) for x in _golden_logps("lora", "ref"))
    lens = [Tensor(GOLDEN[f"data/{side}_lens"].astype(np.float32)) for side in ("chosen", "rejected")]
    losses, (reward_c, reward_r) = pair_losses(CASES[case], chosen, rejected, ref_c, ref_r, *lens)
    want = GOLDEN[f"lora/{case}/dpo_loss_per_pair" if case == "rpo" else f"lora/{case}/loss_per_pair"]
    if case == "orpo":  # TRL stores the odds-ratio term β·logσ(log odds) per pair
        want = -GOLDEN["lora/orpo/or_term_per_pair"]
    np.testing.assert_allclose(losses.asnumpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reward_c.asnumpy(), GOLDEN[f"lora/{case}/rewards_chosen"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(reward_r.asnumpy(), GOLDEN[f"lora/{case}/rewards_rejected"], rtol=1e-5, atol=1e-6)
    loss = float(preference_loss(CASES[case], chosen, rejected, ref_c, ref_r, *lens)[0].asnumpy())
    if case == "orpo":
        # mindqwen's NLL covers the chosen responses (TRL's ORPOTrainer also puts it on the prompt
        # tokens): the response-only NLL per token is −Σπ_c / Σ|c|, TRL's RPO term
        nll = float(GOLDEN["lora/rpo/nll_loss"])
        assert loss == pytest.approx(nll - float(GOLDEN["lora/orpo/or_term_per_pair"].mean()), rel=1e-5)
    else:
        assert loss == pytest.approx(float(GOLDEN[f"lora/{case}/loss"]), rel=1e-5, abs=1e-6)


def test_torchtune_closed_form_dpo_values():
    """torchtune's DPO loss test: policy log-probs (−5, −20)/(−10, −5)... its closed-form values."""
    beta = 0.1
    chosen, rejected = Tensor(np.array([-0.5, -10.0, -1.0], np.float32)), Tensor(np.array([-10.0, -0.5, -1.0], np.float32))
    ref_c, ref_r = Tensor(np.array([-10.0, -0.5, -1.0], np.float32)), Tensor(np.array([-0.5, -10.0, -1.0], np.float32))
    ones = Tensor(np.ones(3, np.float32))
    losses, _ = pair_losses(PreferenceConfig("sigmoid", beta=beta), chosen, rejected, ref_c, ref_r, ones, ones)
    margins = np.array([19.0, -19.0, 0.0])  # (π_c − ref_c) − (π_r − ref_r)
    np.testing.assert_allclose(losses.asnumpy(), np.log1p(np.exp(-beta * margins)), rtol=1e-6)
    assert float(losses.asnumpy()[2]) == pytest.approx(math.log(2), abs=1e-7)


def _lora_model():
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    return load_adapter(model, fixture_path("qwen2_tiny", "lora_adapter"))


def _peft_name(name):  # "model.layers.0.self_attn.q_proj.lora_a" → the adapter file's key
    path, kind = name.rsplit(".", 1)
    return f"base_model.model.{path}.{'lora_A' if kind == 'lora_a' else 'lora_B'}.weight"


@pytest.mark.parametrize("mode", ["graph", "pynative"])
@pytest.mark.parametrize("case", ["sigmoid", "ipo", "rpo", "simpo"])
def test_lora_loss_log_probs_and_gradients_equal_trl(case, mode):
    """Policy = base + adapter, reference = the same weights with the adapters off (no copy)."""
    model = _lora_model()
    reference = reference_view(model) if CASES[case].uses_reference else None
    net = PreferenceLoss(model, CASES[case], reference)
    params = model.trainable_params()
    with in_mode(ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE):
        net.set_train(True)
        batch = net.prepare(tuple(Tensor(a) for a in _batch()))  # + the reference's log-probs
        (loss, *reported), grads = ms.value_and_grad(net, None, params, has_aux=True)(*batch)
    assert float(loss.asnumpy()) == pytest.approx(float(GOLDEN[f"lora/{case}/loss"]), rel=2e-5)
    if reference is not None:  # the adapters off: the base model's log-probs
        np.testing.assert_allclose(batch[2].asnumpy(), np.stack(_golden_logps("lora", "ref"), 1), rtol=1e-5)
    chosen, rejected = _golden_logps("lora", "policy")
    named = dict(zip(PreferenceLoss.reported, (float(r.asnumpy()) for r in reported)))
    assert named["logps/chosen"] == pytest.approx(float(chosen.mean()), rel=1e-5)
    assert named["logps/rejected"] == pytest.approx(float(rejected.mean()), rel=1e-5)
    assert named["rewards/chosen"] == pytest.approx(float(GOLDEN[f"lora/{case}/rewards_chosen"].mean()), abs=1e-5)
    for p, g in zip(params, grads):
        want = GOLDEN[f"lora/{case}/grad/{_peft_name(p.name)}"]
        np.testing.assert_allclose(g.asnumpy(), want, atol=1e-4 * np.abs(want).max(), err_msg=p.name)


def test_first_lora_step_is_ln2_exactly():
    """B = 0: the policy is the reference, so the sigmoid loss is ln 2 and the rewards 0."""
    model = _lora_model()
    for p in model.trainable_params():
        if "lora_b" in p.name:
            p.set_data(Tensor(np.zeros(p.shape, np.float32)))
    net = PreferenceLoss(model, CASES["sigmoid"], reference_view(model))
    with in_mode(ms.GRAPH_MODE):
        loss, reward_c, reward_r, *_ = net(*net.prepare(tuple(Tensor(a) for a in _batch())))
    assert float(loss.asnumpy()) == np.float32(math.log(2))
    assert float(reward_c.asnumpy()) == 0 and float(reward_r.asnumpy()) == 0


@pytest.mark.parametrize("case", ["sigmoid", "hinge", "orpo"])
def test_full_weights_with_a_frozen_reference_equal_trl(case):
    """Policy = the merged model, every weight trained; reference = a frozen copy of the base."""
    policy = from_pretrained(fixture_path("qwen2_tiny", "merged"))
    reference = frozen_copy(from_pretrained(fixture_path("qwen2_tiny", "base"))) if CASES[case].uses_reference else None
    net = PreferenceLoss(policy, CASES[case], reference)
    params = policy.trainable_params()
    with in_mode(ms.GRAPH_MODE):
        net.set_train(True)
        batch = net.prepare(tuple(Tensor(a) for a in _batch()))
        (loss, *_), grads = ms.value_and_grad(net, None, params, has_aux=True)(*batch)
    grads = dict(zip((p.name for p in params), grads))
    if case == "orpo":  # the NLL on the responses only (see the pair-loss test)
        assert float(loss.asnumpy()) == pytest.approx(
            float(GOLDEN["full/rpo/nll_loss"] - GOLDEN["full/orpo/or_term_per_pair"].mean()), rel=2e-5)
        return
    assert float(loss.asnumpy()) == pytest.approx(float(GOLDEN[f"full/{case}/loss"]), rel=2e-5)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.mlp.down_proj.weight", "model.norm.weight"):
        want = GOLDEN[f"full/{case}/grad/{name}"]
        rows = GOLDEN[f"full/grad_rows/{name}"] if f"full/grad_rows/{name}" in GOLDEN else slice(None)
        got = grads[name].asnumpy()[rows]
        np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), err_msg=name)


def _fit_pairs(out, steps, resume=None, level="O2"):
    from mindqwen import LoraConfig, PrecisionConfig, TrainerConfig, apply_lora, fit
    from mindqwen.data.loader import TokenDataset
    ids, labels = _batch()
    pairs = TokenDataset(np.tile(ids, (4, 1, 1)), np.tile(labels, (4, 1, 1)))  # 12 pairs
    ms.set_seed(0)
    model = apply_lora(from_pretrained(fixture_path("qwen2_tiny", "base")), LoraConfig(r=4, lora_alpha=8))
    config = TrainerConfig(max_steps=steps, micro_batch_size=2, gradient_accumulation=2, lr=5e-3, warmup_steps=1,
                           save_every=2, resume=resume, output_dir=str(out), progress=False,
                           precision=PrecisionConfig(level=level, dtype="float16"))
    fit(model, pairs, config)  # the default loss: sigmoid DPO, the adapters off as the reference
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def test_fit_on_pairs_in_fp16_resumes_bit_identically_with_finite_rewards(tmp_path):
    straight = _fit_pairs(tmp_path / "a", 4)
    assert straight[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # B = 0 (fp16 matmuls: not to the bit)
    assert all(np.isfinite(r[k]) for r in straight for k in PreferenceLoss.reported + ("loss", "grad_norm"))
    assert straight[-1]["rewards/margins"] > 0  # it learns to prefer the chosen responses
    _fit_pairs(tmp_path / "b", 2)
    resumed = _fit_pairs(tmp_path / "b", 4, resume="auto")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["rewards/chosen"] for r in resumed] == [r["rewards/chosen"] for r in straight]


def _letter_pairs(tmp_path):
    """A tokenizer and train / eval pair files in the standard form."""
    from mindqwen.data.tokenizer import train_sentencepiece
    from mindqwen.demos.letters import make_demo_data, near_miss
    import random
    demo = make_demo_data(0, 10, 24, 8, alphabet=6)
    rng = random.Random(1)
    train_sentencepiece([p + r for p, r in demo.pretrain + demo.train] * 5, str(tmp_path / "tok.model"), 60)
    for name, pairs in (("train", demo.train), ("eval", demo.eval)):
        with open(tmp_path / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for prompt, answer in pairs:
                f.write(json.dumps({"prompt": prompt, "chosen": answer, "rejected": near_miss(answer, rng, 6)}) + "\n")
    return [f"data.tokenizer={tmp_path / 'tok.model'}", f"data.train={tmp_path / 'train.jsonl'}",
            f"data.eval={tmp_path / 'eval.jsonl'}"]


def test_preference_recipe_runs_end_to_end_and_reuses_its_precomputed_reference(tmp_path):
    """The task: validate, train (full weights, log-probs computed once), the summary, the metrics'
    TRL names; a second run reuses the reference log-probs (same weights, same data)."""
    from mindqwen.tasks import task_for, train_recipe
    from mindqwen.train.recipe import RecipeError, load_recipe
    settings = _letter_pairs(tmp_path) + [
        f"model.checkpoint={fixture_path('qwen2_tiny', 'base')}", "model.adapter=null", "model.config={}",
        "data.seq_length=40", "data.synthetic=null",
        "preference.sft_weight=0.5", "trainer.max_steps=3", "trainer.warmup_steps=1", "trainer.micro_batch_size=4", "trainer.progress=false",
        "lora=null", f"trainer.output_dir={tmp_path / 'run'}"]
    recipe = load_recipe("demo/preference", settings)
    assert task_for(recipe).reference() == "precompute"
    report = task_for(recipe).validate("r")
    assert "train 24 pairs, eval 8 pairs" in report and "reference precompute" in report
    summary = train_recipe(recipe)
    assert 0 <= summary["preference_accuracy_after"] <= 1 and "exact_match_before" in summary
    reference = np.load(tmp_path / "run" / "reference" / "train.npy")
    assert reference.shape == (24, 2) and np.all(reference < 0)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert set(PreferenceLoss.reported) <= set(records[0]) and "eval_loss" in records[-1]
    # the same weights and data: the kept log-probs; other weights: computed anew
    from mindqwen.data.preference import load_pairs
    from mindqwen.data.tokenizer import load_tokenizer
    task, stamp = task_for(recipe), (tmp_path / "run" / "reference" / "train.npy").stat().st_mtime_ns
    rows, _ = load_pairs(recipe.data.train, load_tokenizer(recipe.data.tokenizer), 40)
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    np.testing.assert_array_equal(task._precomputed(model, rows, "train"), reference)
    assert (tmp_path / "run" / "reference" / "train.npy").stat().st_mtime_ns == stamp
    model.model.norm.weight.set_data(model.model.norm.weight * 1.5)
    assert not np.array_equal(task._precomputed(model, rows, "train"), reference)
    with pytest.raises(RecipeError, match="adapter_off needs a lora section"):
        task_for(load_recipe("demo/preference", settings + ["preference.reference=adapter_off"])).validate("r")
    with pytest.raises(RecipeError, match=r"cannot use pretrain \(preference tuning starts from a trained model"):
        task_for(load_recipe("demo/preference", settings + ["pretrain.max_steps=100"])).validate("r")


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo"])
def test_a_loss_that_needs_a_reference_refuses_pairs_without_one_by_name(loss_type, tmp_path):
    """Built without a reference model, on pairs without reference_logps: refused (fit before any
    step, ``prepare``, a direct call), never trained against a zero reference."""
    from mindqwen import TrainerConfig, fit
    from mindqwen.data.loader import TokenDataset
    from mindqwen.preference import default_preference_loss
    model = _lora_model()
    net = PreferenceLoss(model, PreferenceConfig(loss_type), None)
    ids, labels = _batch()
    batch = (Tensor(ids), Tensor(labels))
    refused = rf"preference loss '{loss_type}' needs reference log-probs.*reference_logps.*reference_view"
    with pytest.raises(ValueError, match=refused):
        fit(model, TokenDataset(ids, labels), TrainerConfig(max_steps=1, micro_batch_size=3,
                                                            output_dir=str(tmp_path / "run"), progress=False),
            loss_net=net)
    assert not (tmp_path / "run").exists()  # refused before the run started
    with pytest.raises(ValueError, match=refused):
        net.prepare(batch)
    with in_mode(ms.GRAPH_MODE), pytest.raises(ValueError, match=refused):
        net(*batch)
    # the paths that give a reference: the data's log-probs (every split), the adapters off, none needed
    logps = np.stack(_golden_logps("lora", "ref"), 1)
    with_ref = TokenDataset(ids, labels, reference_logps=logps)
    assert len(net.prepare(batch + (Tensor(logps),))) == 3
    net.check_reference(with_ref, None)
    with pytest.raises(ValueError, match=refused):  # the eval split without them
        net.check_reference(with_ref, TokenDataset(ids, labels))
    from_data = default_preference_loss(model, with_ref, PreferenceConfig(loss_type))
    assert from_data.reference is None and from_data.prepare(batch + (Tensor(logps),))[2] is not None
    adapters_off = default_preference_loss(model, TokenDataset(ids, labels), PreferenceConfig(loss_type))
    assert adapters_off.missing_reference is None and len(adapters_off.prepare(batch)) == 3
    assert PreferenceLoss(model, PreferenceConfig("simpo"), None).prepare(batch) == batch
