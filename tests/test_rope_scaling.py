"""Rope scaling past ``max_position_embeddings`` against HF transformers (fixtures/rope_scaling.npz,
written by fixtures/make_rope_golden.py): each tiny model with max_position_embeddings 32 and
default, linear, dynamic, yarn or llama3 rope runs 80 positions, in the forward pass, the training
loss and greedy KV-cache generation; past a model's context length, one line says so."""
import json
import os

import mindspore as ms
import numpy as np
import pytest

from conftest import fixture_path
from mindqwen import QwenConfig, QwenForCausalLM
from mindqwen.config import ConfigError
from mindqwen.export.mindir import check_export, deploy_copy, export_model
from mindqwen.generation import generate
from mindqwen.io.hf import load_weights
from mindqwen.train.recipe import load_recipe

GOLDEN = np.load(fixture_path("rope_scaling.npz"))
MODELS = ("qwen2_tiny", "qwen3_tiny")
CASES = ("default", "linear", "dynamic", "yarn", "llama3")
TOL = 5e-5  # fp32 max-abs logits (fixtures/REF_README.md)
LOSS_TOL = 1e-5


def _config(model_name: str, case: str) -> QwenConfig:
    with open(fixture_path(model_name, "base", "config.json")) as f:
        hf = json.load(f)
    return QwenConfig.from_hf({**hf, **json.loads(str(GOLDEN[f"{model_name}/{case}/config_json"]))})


def _model(model_name: str, case: str) -> QwenForCausalLM:
    model = QwenForCausalLM(_config(model_name, case))
    load_weights(model, fixture_path(model_name, "base"))
    model.set_train(False)
    return model


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("model_name", MODELS)
def test_forward_past_max_position_embeddings_matches_hf(model_name, case, mode):
    """80 positions through a model whose config names 32: logits at positions 7, 15, …, 79 and,
    in PyNative (graph mode would compile a second graph), the training loss with labels =
    input_ids equal HF's; the rope type did act (the default's logits differ)."""
    model = _model(model_name, case)
    ids = ms.Tensor(GOLDEN["input_ids"].astype(np.int32))
    logits = model(ids).asnumpy()[0, GOLDEN["rows"]]
    err = np.abs(logits - GOLDEN[f"{model_name}/{case}/logits"]).max()
    print(f"{model_name} {case} [{mode}] 80 positions, max_position_embeddings 32: max-abs logits vs HF {err:.2e}")
    assert err <= TOL
    if mode == "pynative":
        loss_err = abs(float(model(ids, labels=ids).asnumpy()) - float(GOLDEN[f"{model_name}/{case}/loss"]))
        print(f"  loss vs HF {loss_err:.2e}")
        assert loss_err <= LOSS_TOL
    if case != "default":
        assert np.abs(logits - GOLDEN[f"{model_name}/default/logits"]).max() > 1.0


# Each scaled type once, yarn (Qwen's 128k) on both models: ~10 s each, two graphs to compile.
@pytest.mark.parametrize("model_name, case", [("qwen2_tiny", "yarn"), ("qwen3_tiny", "yarn"), ("qwen2_tiny", "dynamic"),
                                              ("qwen2_tiny", "linear"), ("qwen3_tiny", "llama3")])
def test_greedy_kv_cache_generation_past_max_position_embeddings_matches_hf(model_name, case):
    """A 20-token prompt and 60 greedy tokens through the KV cache (positions 20..79, 48 of them
    past 32): HF's tokens exactly (every golden step's top-2 logit gap exceeds 1e-3)."""
    model = _model(model_name, case)
    prompt = GOLDEN[f"{model_name}/{case}/prompt"].astype(np.int32)
    expected = GOLDEN[f"{model_name}/{case}/tokens"]
    tokens = generate(model, [prompt], max_new_tokens=len(expected))[0, len(prompt):]
    agree = int(np.argmin(tokens == expected)) if (tokens != expected).any() else len(expected)
    print(f"{model_name} {case}: {agree}/{len(expected)} greedy tokens equal HF's "
          f"(min top-2 gap {float(GOLDEN[f'{model_name}/{case}/min_gap']):.1e})")
    np.testing.assert_array_equal(tokens, expected)


def test_generation_past_the_context_length_is_one_line_before_any_graph():
    """Prompt + max_new_tokens past the context length: a ValueError naming both numbers and the
    rule, raised before anything compiles. Without scaling the context is max_position_embeddings;
    with it, factor × the length it stretches."""
    plain = QwenForCausalLM(_config("qwen2_tiny", "default"))
    with pytest.raises(ValueError, match=r"^prompt 0: 20 tokens \+ max_new_tokens 13 = 33 exceeds the model's 32 "
                                         r"positions \(max_position_embeddings\)$"):
        generate(plain, [list(range(20))], max_new_tokens=13)
    yarn = QwenForCausalLM(_config("qwen2_tiny", "yarn"))
    with pytest.raises(ValueError, match=r"20 tokens \+ max_new_tokens 109 = 129 exceeds the model's 128 positions "
                                         r"\(rope_scaling yarn: factor 4 × original_max_position_embeddings 32\)$"):
        generate(yarn, [list(range(20))], max_new_tokens=109)


@pytest.mark.parametrize("hf, length, rule", [
    ({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768,  # Qwen2.5-7B-Instruct, 128k on
      "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     131072, "rope_scaling yarn: factor 4 × original_max_position_embeddings 32768"),
    ({"architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 40960, "head_dim": 128,  # Qwen3-8B, 128k on
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     131072, "rope_scaling yarn: factor 4 × original_max_position_embeddings 32768"),
    ({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768}, 32768, "max_position_embeddings"),
    ({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 4096,
      "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
     8192, "rope_scaling linear: factor 2 × max_position_embeddings 4096"),
    ({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 131072,  # a Llama-3.1-style table
      "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192, "rope_theta": 5e5}},
     131072, "max_position_embeddings"),
])
def test_context_length_of_qwen_128k_configs(hf, length, rule):
    config = QwenConfig.from_hf(hf)
    assert (config.context_length, config.context_rule) == (length, rule)


def test_rope_scaling_a_model_cannot_run_is_a_config_error():
    base = {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32}
    with pytest.raises(ConfigError, match=r"rope_type='longrope' is not supported; supported: default, linear, "
                                          r"dynamic, yarn, llama3"):
        QwenConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                                                     "long_factor": [1.0], "original_max_position_embeddings": 16}})
    with pytest.raises(ConfigError, match=r"rope_type='llama3' needs low_freq_factor, high_freq_factor"):
        QwenConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                     "original_max_position_embeddings": 16}})
    with pytest.raises(ConfigError, match=r"rope_type='linear' needs factor"):
        QwenConfig.from_hf({**base, "rope_scaling": {"rope_type": "linear"}})


@pytest.mark.parametrize("case", ["yarn", "dynamic"])
def test_export_copy_reads_a_table_as_long_as_its_cache(case):
    """The exported graphs' rotary is a table of max_seq_len positions, no float64 op in the
    deployed graph (dynamic, whose frequencies follow the length: fp32 cos/sin per call): the
    same logits as the eager model at 80 positions; max_seq_len is held to the context length."""
    model = _model("qwen2_tiny", case)
    ids = ms.Tensor(GOLDEN["input_ids"].astype(np.int32))
    exported = deploy_copy(model, "float32", max_seq_len=80)
    assert exported.model.rotary_emb.table_length == 80
    diff = np.abs(exported(ids).asnumpy() - model(ids).asnumpy()).max()
    print(f"qwen2_tiny {case}: deploy copy (rotary table) vs eager model, 80 positions: {diff:.1e}")
    assert diff <= 1e-6
    check_export(model.config, [1], 128, [64, 128], "float32", "Ascend310", None, ())
    with pytest.raises(ValueError, match=r"max_seq_len must be in 2\.\.128 \(rope_scaling .*: factor 4 × "
                                         r"(original_)?max_position_embeddings 32\), got 129"):
        check_export(model.config, [1], 129, [64, 129], "float32", "Ascend310", None, ())


def test_yarn_export_past_max_position_embeddings_passes_its_parity_check(tmp_path):
    """MindIR prefill + decode of the yarn model with a 64-slot cache, run by the export's own
    runner in a fresh process: a 40-token prompt and 6 greedy tokens (positions to 45, past 32)
    equal the eager steps and the full forward (``parity.json``)."""
    manifest = export_model(_model("qwen2_tiny", "yarn"), str(tmp_path / "out"), [1], 64, [40])
    with open(tmp_path / "out" / "parity.json") as f:
        report = json.load(f)
    print(f"qwen2_tiny yarn export, 64 slots: vs eager steps {report['eager_same_steps']['max_abs_logit_diff']:.1e}, "
          f"vs full forward {report['full_recompute']['max_abs_logit_diff']:.1e}")
    assert manifest["max_seq_len"] == 64 and report["passed"] and report["prompt_lengths"] == [40]


def test_the_recipe_line_for_128k_gives_131072_positions():
    """recipes/qwen3/8b_lora.yaml carries the 128k setting commented out: uncommented (here, its
    value as an override) the recipe loads and its model runs 131072 positions."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "qwen3", "8b_lora.yaml")
    with open(path) as f:
        line = next(line for line in f if line.strip().startswith("# config: {rope_scaling"))
    recipe = load_recipe(path, [f"model.config={line.split('config:', 1)[1].strip()}"])
    config = QwenConfig.from_preset(recipe.model.preset, **recipe.model.config)
    assert (config.max_position_embeddings, config.context_length) == (40960, 131072)
