"""`mindqwen estimate`: parameter counts against published model sizes and the fit verdicts of
bundled recipes. The memory total against a measured CPU peak is a benchmark
(``benchmarks/estimate_check.py``, docs/performance.md), not a unit test."""
import os
import subprocess
import sys

import pytest

from mindqwen import QwenConfig
from mindqwen.estimate import GB, model_parameters, parameter_counts

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
        layer, embed, head = parameter_counts(config)
        assert total == config.num_hidden_layers * layer + embed + head + config.hidden_size  # + final norm


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
