"""ckpt_tools/inspect_ckpt.py: counts equal the closed form of the tiny config."""
import json
import os
import subprocess
import sys

from conftest import fixture_path

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpt_tools", "inspect_ckpt.py")


def test_inspect_counts_parameters():
    c = json.load(open(fixture_path("qwen2_tiny", "base", "config.json")))
    h, i, v, n_layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k/v (+bias), o, mlp, norms: 12 tensors
    expected = v * h + n_layers * per_layer + h  # tied head: not stored
    r = subprocess.run([sys.executable, TOOL, fixture_path("qwen2_tiny", "base")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f"{2 + 12 * n_layers} tensors, {expected:,d} parameters; dtypes: F32 {expected:,d}" in r.stdout
    assert "model.layers.*.mlp" in r.stdout


def test_inspect_bad_path_is_one_line():
    r = subprocess.run([sys.executable, TOOL, "no/such"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == "inspect: error: no/such: checkpoint folder not found"


def test_diff_reports_max_abs_difference_and_key_sets():
    same = subprocess.run([sys.executable, TOOL, fixture_path("qwen2_tiny", "base"), "--diff",
                           fixture_path("qwen2_tiny", "base")], capture_output=True, text=True)
    assert same.returncode == 0 and "0 differ (max |Δ| 0.000e+00); 0 only in" in same.stdout
    r = subprocess.run([sys.executable, TOOL, fixture_path("qwen2_tiny", "base"), "--diff",
                        fixture_path("qwen2_tiny", "merged")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    # PEFT's merge changes exactly the LoRA targets (q_proj, v_proj weights of both layers)
    changed = [line.split()[0] for line in r.stdout.splitlines() if "max |Δ|" in line and not line.startswith(" ")
               and "shared tensors" not in line]
    assert sorted(changed) == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv")
