"""The Qwen3.5 presets against the published checkpoints, the estimator on hybrid layers, and the bundled
Qwen3.5 recipes.

A published Qwen3.5 checkpoint is the vision-language model: its safetensors index counts the language model
(the preset), the vision tower and one multi-token-prediction (MTP) layer. Each preset must give exactly that
total with the two closed forms below (and, where a loader reported it, exactly the language model's own
count): a 10- or 12-digit total leaves no room for a wrong width, head count or tying.
"""
import glob
import math
import os

import pytest

from mindqwen.config import QwenConfig
from mindqwen.estimate import activation_bytes_per_layer, estimate_recipe, layer_parameters, model_parameters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# `safetensors.total` of the Hub's Qwen/Qwen3.5-* repositories (BF16 and F32 parameters of every tensor), as
# quoted by independent repositories (model catalogs, checkpoint audits), and the vision tower of each
# (vision_config depth, hidden_size, intermediate_size; out_hidden_size is the LM's hidden size).
PUBLISHED = {
    "qwen3.5-0.8b": (873_438_784, (12, 768, 3072)),
    "qwen3.5-2b": (2_274_069_824, (24, 1024, 4096)),
    "qwen3.5-4b": (4_659_865_088, (24, 1024, 4096)),
    "qwen3.5-9b": (9_653_104_368, (27, 1152, 4304)),
    "qwen3.5-27b": (27_781_427_952, (27, 1152, 4304)),
    "qwen3.5-35b-a3b": (35_951_822_704, (27, 1152, 4304)),
    "qwen3.5-122b-a10b": (125_086_497_008, (27, 1152, 4304)),
    "qwen3.5-397b-a17b": (403_397_928_944, (27, 1152, 4304)),
}
# The language model alone, where a loader reported it: llama.cpp's n_params of the text GGUF (0.8B, 2B),
# transformers' Qwen3_5ForCausalLM loaded from the checkpoint (2B), checkpoint audits that split the header's
# shapes into language / vision / MTP (2B, 4B, 397B).
LANGUAGE = {"qwen3.5-0.8b": 752_393_024, "qwen3.5-2b": 1_881_825_088, "qwen3.5-4b": 4_205_751_296,
            "qwen3.5-397b-a17b": 396_346_350_336}
# Activated parameters as the model cards give them ("3B", "10B", "17B"), language model only.
ACTIVE = {"qwen3.5-35b-a3b": 3e9, "qwen3.5-122b-a10b": 10e9, "qwen3.5-397b-a17b": 17e9}


def vision_parameters(depth: int, width: int, mlp: int, out: int, patch: int = 16, temporal: int = 2,
                      positions: int = 2304, merge: int = 2) -> int:
    """The Qwen3-VL-style vision tower of transformers' Qwen3_5VisionModel: a Conv3d patch embedding (with
    bias), a learned position table, ``depth`` blocks (two LayerNorms, qkv and proj, a GELU MLP, all with
    biases), and the merger (LayerNorm, then two Linears over merge² patches, the last to the LM's width)."""
    block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width) \
        + (width * mlp + mlp) + (mlp * width + width)
    merged = width * merge * merge
    merger = 2 * width + (merged * merged + merged) + (merged * out + out)
    return 3 * temporal * patch * patch * width + width + positions * width + depth * block + merger


def mtp_parameters(config: QwenConfig) -> int:
    """The MTP head (``mtp.*``): fc [H, 2H] over the two normed inputs, their two norms, one full-attention
    decoder layer (MLP or mixture of experts as the model's), and its final norm; embedding and head shared."""
    h = config.hidden_size
    full = config.layer_types.index("full_attention")
    return 2 * h * h + 2 * h + layer_parameters(config, full)[0] + h


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_gives_the_published_parameter_count(preset):
    config = QwenConfig.from_preset(preset)
    total, active = model_parameters(config)
    assert total == sum(math.prod(shape) for shape in config.tensor_shapes().values())
    checkpoint, (depth, width, mlp) = PUBLISHED[preset]
    assert total + vision_parameters(depth, width, mlp, config.hidden_size) + mtp_parameters(config) == checkpoint
    if preset in LANGUAGE:
        assert total == LANGUAGE[preset]
    if preset in ACTIVE:
        assert abs(active - ACTIVE[preset]) < 0.5e9
    else:
        assert active == total


def _published(text_config: dict, tie: bool, moe: bool = False) -> dict:
    """A config.json as the Hub's Qwen3.5 checkpoints write it: the vision-language model, the text shape
    under ``text_config`` with transformers 5's ``rope_parameters`` (the ``vision_config`` beside it is not
    read, so it is left out)."""
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    text = dict(text_config, model_type="qwen3_5_moe_text" if moe else "qwen3_5_text", head_dim=256,
                vocab_size=248320, attention_bias=False, full_attention_interval=4, linear_num_key_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                 "mrope_interleaved": True, "mrope_section": [11, 11, 10]})
    return {"architectures": [arch], "model_type": "qwen3_5_moe" if moe else "qwen3_5", "tie_word_embeddings": tie,
            "text_config": text}


# text_config values of the published config.json files (as checkpoint validators and model-serving code
# copy them): Qwen3.5-0.8B (tied), Qwen3.5-27B, Qwen3.5-35B-A3B.
PUBLISHED_CONFIGS = {
    "qwen3.5-0.8b": _published(dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                                    num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16), True),
    "qwen3.5-27b": _published(dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                   num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48), False),
    "qwen3.5-35b-a3b": _published(dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                       num_key_value_heads=2, linear_num_value_heads=32, num_experts=256,
                                       num_experts_per_tok=8, moe_intermediate_size=512,
                                       shared_expert_intermediate_size=512, router_aux_loss_coef=0.001),
                                  False, moe=True),
}


@pytest.mark.parametrize("preset", list(PUBLISHED_CONFIGS))
def test_preset_equals_the_published_config_json(preset):
    """A preset is what ``QwenConfig.from_hf`` makes of the checkpoint's config.json (its language model)."""
    loaded, config = QwenConfig.from_hf(PUBLISHED_CONFIGS[preset]), QwenConfig.from_preset(preset)
    assert loaded.tensor_shapes() == config.tensor_shapes()
    for name in ("model_type", "layer_types", "rotary_dim", "rope_theta", "rms_norm_eps", "max_position_embeddings",
                 "tie_word_embeddings", "qk_norm", "qkv_bias", "num_experts_per_tok", "norm_topk_prob"):
        assert getattr(loaded, name) == getattr(config, name), name


def test_estimator_counts_the_built_hybrid_model():
    """The closed form against the Cells: a tiny Qwen3.5-MoE with both kinds of layer."""
    from mindqwen.io.hf import no_init_parameters
    from mindqwen.models.qwen import QwenForCausalLM
    config = QwenConfig(model_type="qwen3_5_moe", vocab_size=64, hidden_size=24, intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=8, shared_expert_intermediate_size=12, norm_topk_prob=True,
                        qkv_bias=False, qk_norm=True, tie_word_embeddings=False)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    with no_init_parameters():
        model = QwenForCausalLM(config)
    assert model_parameters(config)[0] == sum(math.prod(p.shape) for p in model.get_parameters())


def test_linear_attention_layers_keep_no_scores():
    """At a fixed number of tokens a longer sequence costs a Gated DeltaNet layer nothing more (its state is
    per chunk, not per token pair), and an attention layer its seq² fp32 scores (CPU: no flash attention)."""
    config = QwenConfig.from_preset("qwen3.5-0.8b")
    linear, full = config.layer_types.index("linear_attention"), config.layer_types.index("full_attention")

    def kept(index: int, seq: int) -> float:  # 4096 tokens, fp32, no flash attention
        return activation_bytes_per_layer(config, index, 4096, seq, False, False)

    assert kept(linear, 4096) == kept(linear, 1024)
    assert kept(full, 4096) - kept(full, 1024) == 4096 * config.num_attention_heads * (4096 - 1024) * 4 * 2


BUNDLED = sorted(glob.glob(os.path.join(ROOT, "recipes", "qwen3_5", "*.yaml")))


@pytest.mark.parametrize("path", BUNDLED, ids=os.path.basename)
def test_bundled_recipes_validate_tiny_and_fit_where_they_say(path):
    from mindqwen.tasks import validate_recipe
    from mindqwen.train.recipe import load_recipe
    assert len(BUNDLED) == 2  # one card, eight cards
    assert validate_recipe(path, tiny=True).startswith(f"{path}: ok")
    estimate = estimate_recipe(load_recipe(path), "910B")
    assert estimate.fits, estimate.parts
