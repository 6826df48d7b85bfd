"""Qwen3.5 export: the prefill (one graph per prompt bucket) and decode MindIR carry the linear-attention
states as fixed-size inputs and outputs beside the KV cache; run in a fresh process without mindqwen, their
greedy tokens and per-step logits equal HF's generate (fixtures/qwen3_5 goldens), dense and MoE, with a
left-padded row."""
import json
import os

import numpy as np
import pytest

from conftest import fixture_path
from mindqwen import from_pretrained
from mindqwen.export import export_model
from test_export import _run_exported

PROMPT, NEW = 30, 20  # the goldens' prompt length and new tokens
# Relative to HF's largest logit. HF's own fp32 rounding is ~5e-6; the exported graphs take the decays through
# the device's fp32 exp (no float64 op in an export), which adds up to ~1e-5 (measured: 1.1e-5 dense, 5.6e-6 MoE).
LOGIT_TOL = 2e-5


def golden(name):
    return dict(np.load(fixture_path("qwen3_5", name, "golden.npz")))


@pytest.fixture(scope="module", params=["qwen3_5_tiny", "qwen3_5_moe_tiny"])
def exported(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("export") / request.param)
    manifest = export_model(from_pretrained(fixture_path("qwen3_5", request.param)), folder, batch_sizes=[1, 2],
                            max_seq_len=64, seq_buckets=[32, 64])
    return request.param, folder, manifest


def test_files_manifest_and_parity(exported):
    name, folder, manifest = exported
    assert sorted(os.listdir(folder)) == ["decode.mindir", "lite", "manifest.json", "parity.json",
                                          "prefill_32.mindir", "prefill_64.mindir", "run_exported.py"]
    # 4 layers: 3 Gated DeltaNet (conv_dim 128, kernel 4; 4 value heads of 16 × 16), 1 attention (2 KV heads of 32)
    assert manifest["cache"]["shape"] == [1, -1, 2, 64, 32]
    assert manifest["states"] == [{"name": "conv_state", "shape": [3, -1, 128, 3], "dtype": "float32"},
                                  {"name": "recurrent_state", "shape": [3, -1, 4, 16, 16], "dtype": "float32"}]
    for graph in manifest["graphs"].values():
        assert [i["name"] for i in graph["inputs"]][-2:] == ["conv_state", "recurrent_state"]
        assert [o["name"] for o in graph["outputs"]] == ["logits", "k_cache", "v_cache", "conv_state",
                                                         "recurrent_state"]
    assert manifest["graphs"]["prefill_32"]["inputs"][0]["shape"] == [-1, 32]
    with open(os.path.join(folder, "parity.json")) as f:
        parity = json.load(f)
    print(name, {k: parity[k] for k in ("eager_same_steps", "full_recompute")})
    assert parity["passed"] and parity["eager_same_steps"]["max_abs_logit_diff"] <= 1e-5


def test_converter_gears_fix_the_batch_of_the_states(exported):
    _, folder, _ = exported
    with open(os.path.join(folder, "lite", "prefill_32.cfg")) as f:
        text = f.read()
    shapes = dict(item.split(":") for item in text.split("input_shape=")[1].split("\n")[0].split(";"))
    assert shapes["conv_state"] == "3,-1,128,3" and shapes["input_ids"] == "-1,32"
    gears = text.split("ge.dynamicDims=")[1].split("\n")[0]
    assert gears == "1,1,1,1,1,1,1,1;2,2,2,2,2,2,2,2"  # one per batch size; the sequence is static


def test_exported_generation_equals_hf(exported, tmp_path):
    """Greedy tokens and every step's logits through the runner, plain rows and a left-padded one."""
    name, folder, _ = exported
    g = golden(name)
    pad = int((g["gen_attention_mask_padded"][1] == 0).sum())
    for prompts, ids, logits_key in (
            (g["gen_prompt"].tolist(), g["gen_ids"], "gen_logits"),
            ([g["gen_prompt_padded"][0].tolist(), g["gen_prompt_padded"][1, pad:].tolist()], g["gen_ids_padded"],
             "gen_logits_padded")):
        request, dump = tmp_path / "prompts.json", str(tmp_path / "out.npz")
        request.write_text(json.dumps(prompts))
        _run_exported(folder, "--prompts", str(request), "--max-new-tokens", str(NEW), "--dump", dump)
        out = np.load(dump)
        err = float(np.abs(out["logits"] - g[logits_key]).max() / np.abs(g[logits_key]).max())
        print(f"{name} {logits_key}: exported vs HF logits {err:.1e}")
        assert np.array_equal(out["tokens"], ids[:, PROMPT:])
        assert err <= LOGIT_TOL


def test_float16_export_follows_its_eager_steps(tmp_path):
    manifest = export_model(from_pretrained(fixture_path("qwen3_5", "qwen3_5_tiny")), str(tmp_path / "fp16"),
                            max_seq_len=64, seq_buckets=[32], dtype="float16")
    with open(tmp_path / "fp16" / "parity.json") as f:
        parity = json.load(f)
    assert manifest["states"][0]["dtype"] == "float32"  # the states stay fp32 in a fp16 export
    assert parity["passed"] and parity["eager_same_steps"]["tokens_identical"]
