"""LoRA adapters across namings: PEFT ⇄ mindformers legacy is lossless, and a LoRA on Mcore's fused
linear_qkv exported to per-projection PEFT adapters gives the fused model's logits."""
import json

import mindspore as ms
import numpy as np
import pytest

from conftest import fixture_path, reference
from mindqwen import from_pretrained, load_adapter
from mindqwen.io.adapters import mindformers_to_peft, peft_to_mindformers
from mindqwen.io.convert import read_state
from mindqwen.io.safetensors import SafetensorsFile, save_file
from mindqwen.io.convert import from_format, lazy, part_rows, to_format


def write_adapter(folder, tensors, config):
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config))


def test_peft_to_mindformers_legacy_and_back_is_lossless(tmp_path):
    src = fixture_path("qwen2_tiny", "lora_adapter")
    f = SafetensorsFile(f"{src}/adapter_model.safetensors")
    peft = {k: f.get(k) for k in f.keys()}
    legacy = peft_to_mindformers(peft)
    assert "model.layers.0.attention.wq.lora_a" in legacy and "model.layers.1.attention.wv.lora_b" in legacy
    cfg = from_pretrained(fixture_path("qwen2_tiny", "base")).config
    rows = part_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    back = mindformers_to_peft(legacy, "mindformers", cfg.num_key_value_heads, rows)
    assert set(back) == set(peft) and all(np.array_equal(back[k], peft[k]) for k in peft)
    write_adapter(tmp_path / "a", back, json.loads(open(f"{src}/adapter_config.json").read()))
    ref = reference("qwen2_tiny")
    model = load_adapter(from_pretrained(fixture_path("qwen2_tiny", "base")), str(tmp_path / "a"))
    logits = model(ms.Tensor(ref["input_ids"].astype(np.int32))).asnumpy()
    assert np.abs(logits - ref["logits_lora"]).max() <= 5e-5


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_fused_qkv_lora_exports_exactly_to_peft(layout, tmp_path):
    name, r, alpha = "qwen3_tiny", 4, 8.0
    base = fixture_path(name, "base")
    cfg = from_pretrained(base).config
    rows = part_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
    rng = np.random.default_rng(0)
    fused_rows = sum(rows["qkv"])
    lora = {}
    for i in range(cfg.num_hidden_layers):
        lora[f"decoder.layers.{i}.self_attention.linear_qkv.lora_A.weight"] = rng.normal(0, 0.1, (r, cfg.hidden_size)).astype(np.float32)
        lora[f"decoder.layers.{i}.self_attention.linear_qkv.lora_B.weight"] = rng.normal(0, 0.1, (fused_rows, r)).astype(np.float32)
    # the fused model: merge in fused space, then bring the weights back to HF names
    fused = {k: t.load() for k, t in to_format(read_state(base), "mindformers-mcore", cfg.num_key_value_heads,
                                               qkv=layout).items()}
    for i in range(cfg.num_hidden_layers):
        key = f"decoder.layers.{i}.self_attention.linear_qkv"
        fused[f"{key}.weight"] = (fused[f"{key}.weight"] + alpha / r * lora[f"{key}.lora_B.weight"]
                                  @ lora[f"{key}.lora_A.weight"]).astype(np.float32)
    merged = from_format(lazy(fused), "mindformers-mcore", cfg.num_key_value_heads, rows, qkv=layout)
    model = from_pretrained(base)
    for p in model.get_parameters():
        p.set_data(ms.Tensor(merged[p.name].load()))
    ids = ms.Tensor(reference(name)["input_ids"].astype(np.int32))
    fused_logits = model(ids).asnumpy()
    # the export: per-projection PEFT adapters on the unmerged base
    peft = mindformers_to_peft(lora, "mindformers-mcore", cfg.num_key_value_heads, rows, qkv=layout)
    assert len(peft) == 2 * 3 * cfg.num_hidden_layers  # A and B for q, k, v of every layer
    write_adapter(tmp_path / "peft", peft, {"peft_type": "LORA", "r": r, "lora_alpha": alpha,
                                            "target_modules": ["q_proj", "k_proj", "v_proj"]})
    exported = load_adapter(from_pretrained(base), str(tmp_path / "peft"))(ids).asnumpy()
    assert np.abs(exported - fused_logits).max() <= 2e-5


def test_unknown_adapter_keys_are_named():
    with pytest.raises(KeyError, match="not a LoRA A/B"):
        mindformers_to_peft({"model.layers.0.attention.wq.weight": np.zeros(1)}, "mindformers", 2, {})
    with pytest.raises(KeyError, match="not a PEFT LoRA"):
        peft_to_mindformers({"x.weight": np.zeros(1)})


def test_convert_adapter_tool_round_trips_through_mindformers(tmp_path):
    import os
    import subprocess
    import sys
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpt_tools", "convert_adapter.py")
    src = fixture_path("qwen2_tiny", "lora_adapter")
    run = lambda *a: subprocess.run([sys.executable, tool, *a], capture_output=True, text=True)  # noqa: E731
    r = run(src, str(tmp_path / "mf.safetensors"), "--to", "mindformers")
    assert r.returncode == 0, r.stderr
    r = run(str(tmp_path / "mf.safetensors"), str(tmp_path / "peft"), "--from", "mindformers",
            "--config", fixture_path("qwen2_tiny", "base"), "--r", "8", "--lora-alpha", "32")
    assert r.returncode == 0, r.stderr
    ref = reference("qwen2_tiny")
    model = load_adapter(from_pretrained(fixture_path("qwen2_tiny", "base")), str(tmp_path / "peft"))
    logits = model(ms.Tensor(ref["input_ids"].astype(np.int32))).asnumpy()
    assert np.abs(logits - ref["logits_lora"]).max() <= 5e-5
    bad = run(str(tmp_path / "mf.safetensors"), str(tmp_path / "x"), "--from", "mindformers")
    assert bad.returncode == 1 and "needs --config" in bad.stderr
