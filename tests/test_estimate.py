"""`mindqwen estimate`: parameter counts against published model sizes and the fit verdicts of
bundled recipes. The memory total against a measured CPU peak is a benchmark
(``benchmarks/estimate_check.py``, docs/performance.md), not a unit test."""
import os
import subprocess
import sys

import pytest

from mindqwen import QwenConfig
from mindqwen.estimate import GB, model_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Parameter totals of the published checkpoints (safetensors metadata total_size / 2 bytes).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-7b": 7_615_616_512, "qwen3-8b": 8_190_735_360,
             "qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560}
# Activated parameters as the model cards give them ("3.3B", "22B"; the exact counts 3.35 B, 22.19 B).
ACTIVE = {"qwen3-30b-a3b": (3.3e9, 0.1e9), "qwen3-235b-a22b": (22e9, 0.5e9)}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_parameter_count_equals_published(preset):
    config = QwenConfig.from_preset(preset)
    total, active = model_parameters(config)
    assert total == PUBLISHED[preset]
    if preset in ACTIVE:
        assert abs(active - ACTIVE[preset][0]) < ACTIVE[preset][1]
    else:
        assert active == total


def test_parameter_counts_are_the_models_parameters():
    """The closed form against the Cells on a tiny mixture of experts with a dense layer."""
    from mindqwen import QwenForCausalLM
    config = QwenConfig(model_type="qwen2_moe", vocab_size=64, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                        mlp_only_layers=[1], tie_word_embeddings=False)
    model = QwenForCausalLM(config)
    assert model_parameters(config)[0] == sum(p.size for p in model.get_parameters())


def _estimate(recipe, device, *overrides):
    r = subprocess.run([sys.executable, "-m", "mindqwen", "estimate", os.path.join(ROOT, "recipes", recipe),
                        "--device", device, *overrides], capture_output=True, text=True,
                       env={**os.environ, "GLOG_v": "3"}, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_bundled_recipes_fit_where_they_say():
    assert ": fits" in _estimate("qwen2_5/0.5b_lora.yaml", "910B")
    assert ": fits" in _estimate("qwen2_5/7b_lora.yaml", "910B")
    assert ": fits" in _estimate("qwen2_5/7b_full_8card_tp2_pp4.yaml", "910B")
    assert ": fits" in _estimate("qwen2_5/72b_lora_8card.yaml", "910B")
    # 7B full fine-tune on one card: bf16 weights, gradients and AdamW moments are 8 bytes a parameter
    out = _estimate("qwen2_5/7b_lora.yaml", "910B", "lora=null", "trainer.micro_batch_size=1")
    assert "does NOT fit" in out and "to fit:" in out
    optimizer = float(out.split("optimizer")[1].split("GB")[0])
    assert abs(optimizer - 2 * 7_615_616_512 * 2 / GB) < 0.01


@pytest.mark.parametrize("frames", [1, 4])
def test_multimodal_estimate_counts_every_group_in_closed_form(frames):
    """The shapes recipe (LM hidden 64 in 2 layers; ViT 32 px, patch 8, width 64, MLP 128, 2 blocks;
    cross-attention after both layers), counted by hand and against the built Cells."""
    from mindqwen.estimate import estimate_recipe, format_estimate
    from mindqwen.models.qwen import QwenForCausalLM
    from mindqwen.multimodal.fusion import MultimodalQwen, group_of
    from mindqwen.train.model import model_config
    from mindqwen.train.recipe import load_recipe
    recipe = load_recipe("multimodal/shapes", [f"multimodal.vision.num_frames={frames}"])
    e = estimate_recipe(recipe, "CPU")
    block = 2 * 64 + 4 * (64 * 64 + 64) + 2 * 64 + (64 * 128 + 128) + (128 * 64 + 64)  # norm, attention, norm, MLP
    temporal = 2 * 64 + 4 * (64 * 64 + 64) if frames > 1 else 0  # norm, attention across frames
    embed = 3 * 8 * 8 * 64 + 64 + 16 * 64 + (frames * 64 if frames > 1 else 0)  # patches, 16 positions, frames
    assert e.groups["vision"] == embed + 2 * (block + temporal) + 2 * 64
    assert e.groups["projector"] == (64 * 64 + 64) + (64 * 64 + 64)
    assert e.groups["cross_attention"] == 2 * (64 + 4 * 64 * 64 + 2 * 16 + 1)  # norm, q/k/v/o, q/k norms, gate
    m = recipe.multimodal
    model = MultimodalQwen(QwenForCausalLM(model_config(recipe.model, m.shapes.vocab_size + 1)), m.vision,
                           m.cross_layers, m.shapes.vocab_size)
    built = dict.fromkeys(e.groups, 0)
    for p in model.get_parameters():
        built[group_of(p.name)] += int(p.size)
    assert built == e.groups and e.parameters[0] == sum(built.values())
    assert f"vision {e.groups['vision']:,}" in format_estimate(e)
    # trained, fp32: vision LoRA r 8 on q/k/v/o of 2 blocks (video: r 4 on the temporal ones), the
    # projector, text LoRA r 8 on q, k, v, o, gate, up, down (64→64, 64→32, 64→32, 64→64, 3 × 64↔128)
    # of 2 layers, the cross-attention blocks
    vision_lora = 2 * 4 * 8 * (64 + 64) + (2 * 4 * 4 * (64 + 64) if frames > 1 else 0)
    text_lora = 2 * 8 * (128 + 96 + 96 + 128 + 3 * 192)
    assert e.parts["gradients"] == 4 * (vision_lora + e.groups["projector"] + text_lora + e.groups["cross_attention"])
