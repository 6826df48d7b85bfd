"""``mindqwen validate``: everything about a recipe that can be checked without training.

Type checks (``load_recipe``), required fields, files, the model's shape against the parallel
layout, LoRA targets against the model's modules, and a model build. ``tiny=True`` replaces the
checkpoint by a tiny random model of the same architecture (and skips file checks), so recipes
for 7B–72B models validate in seconds on a laptop.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from typing import Sequence

from mindqwen.config import QwenConfig
from mindqwen.io.hf import no_init_parameters
from mindqwen.lora import apply_lora
from mindqwen.models.qwen import Linear, QwenForCausalLM
from mindqwen.train.distributed import check_model_layout
from mindqwen.train.recipe import Recipe, RecipeError, load_recipe

# A tiny stand-in keeping the architecture's switches (qkv bias, q/k-norm, tying, GQA).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, vocab_size=256, max_position_embeddings=128)


def model_config(recipe: Recipe, path: str) -> QwenConfig:
    """The config the recipe trains: the checkpoint's, else the preset's / explicit one."""
    m = recipe.model
    if m.checkpoint:
        if not os.path.isfile(os.path.join(m.checkpoint, "config.json")):
            raise RecipeError(f"{path}: model.checkpoint: {m.checkpoint} is not an HF folder (no config.json)")
        return QwenConfig.from_hf(m.checkpoint)
    if not m.preset and not m.config:
        raise RecipeError(f"{path}: model: give checkpoint, preset or config")
    if m.preset:
        return QwenConfig.from_preset(m.preset, **m.config)
    return QwenConfig(**{"vocab_size": 256, **m.config})  # vocab follows the demo's tokenizer


def tiny_config(config: QwenConfig) -> QwenConfig:
    kv = 2 if config.num_key_value_heads < config.num_attention_heads else 4
    return dataclasses.replace(config, **TINY, num_key_value_heads=kv, rope_scaling=None,
                               layer_types=None, sliding_window=None, use_sliding_window=False)


def check_files(recipe: Recipe, path: str) -> None:
    d = recipe.data
    if d.synthetic is None:
        if d.train is None:
            raise RecipeError(f"{path}: data.train is required (or data.synthetic for generated data)")
        for key in ("train", "eval", "pretrain", "tokenizer"):
            value = getattr(d, key)
            if value is not None and not os.path.exists(value):
                raise RecipeError(f"{path}: data.{key}: {value} not found")
        if recipe.pretrain is not None and d.pretrain is None:
            raise RecipeError(f"{path}: pretrain needs data.pretrain (a .txt corpus)")


def validate_recipe(path: str, overrides: Sequence[str] = (), tiny: bool = False) -> str:
    """Returns a short report; raises RecipeError (one line, naming the file and key)."""
    recipe = load_recipe(path, overrides)
    if recipe.multimodal is not None:
        return validate_multimodal(recipe, path)
    if not tiny:
        check_files(recipe, path)
    elif recipe.data.synthetic is None and recipe.data.train is None:
        raise RecipeError(f"{path}: data.train is required (or data.synthetic for generated data)")
    if tiny and recipe.model.checkpoint:
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, checkpoint=None))
        config = model_config(recipe, path) if recipe.model.preset or recipe.model.config else None
        if config is None:
            raise RecipeError(f"{path}: --tiny needs model.preset (the architecture) when model.checkpoint is set")
    else:
        config = model_config(recipe, path)
    lora_rank = recipe.lora.r if recipe.lora is not None else 0
    try:
        check_model_layout(config, recipe.parallel, lora_rank)
    except ValueError as e:
        raise RecipeError(f"{path}: parallel: {e}") from None
    built = tiny_config(config) if tiny else config
    with nullcontext() if tiny else no_init_parameters():  # a full-size build allocates nothing
        model = QwenForCausalLM(built)
    if recipe.lora is not None:
        try:
            if tiny:
                apply_lora(model, recipe.lora)
            elif not any(recipe.lora.matches(name) for name, cell in model.cells_and_names() if isinstance(cell, Linear)):
                raise ValueError(f"target_modules={recipe.lora.target_modules!r} matches no module")
        except ValueError as e:
            raise RecipeError(f"{path}: lora.target_modules: {e}") from None
    total = sum(p.size for p in model.get_parameters())
    p = recipe.parallel
    built_note = f" (built tiny: {built.num_hidden_layers} layers, hidden {built.hidden_size})" if tiny else ""
    if recipe.lora is None:
        training = "full fine-tune"
    elif tiny:
        trainable = sum(q.size for q in model.trainable_params())
        training = f"LoRA r={lora_rank}, {trainable:,} of {total:,} parameters trainable as built"
    else:
        training = f"LoRA r={lora_rank} on {total:,} parameters"
    return (f"{path}: ok\n"
            f"  model: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}{built_note}\n"
            f"  training: {training}\n"
            f"  parallel: dp {p.data_parallel} × tp {p.tensor_parallel} × pp {p.pipeline_parallel} = {p.devices} devices")


def validate_multimodal(recipe: Recipe, path: str) -> str:
    """Build the fused model the recipe trains and apply its group policies (errors name the key)."""
    from mindqwen.multimodal.fusion import MultimodalQwen, apply_multimodal_lora, trainable_by_group
    from mindqwen.multimodal.run import unsupported_keys
    m = recipe.multimodal
    if unsupported_keys(recipe):
        raise RecipeError(f"{path}: multimodal recipes do not support {', '.join(unsupported_keys(recipe))} yet")
    config = QwenConfig(**{"vocab_size": m.shapes.vocab_size + 1, **recipe.model.config})
    if recipe.data.seq_length > config.max_position_embeddings:
        raise RecipeError(f"{path}: data.seq_length={recipe.data.seq_length} exceeds model.config."
                          f"max_position_embeddings={config.max_position_embeddings}")
    try:
        model = MultimodalQwen(QwenForCausalLM(config), m.vision, m.cross_layers, config.vocab_size - 1)
    except ValueError as e:
        raise RecipeError(f"{path}: multimodal: {e}") from None
    try:
        apply_multimodal_lora(model, m.policy)
    except ValueError as e:
        raise RecipeError(f"{path}: multimodal.policy: {e}") from None
    counts = trainable_by_group(model)
    groups = ", ".join(f"{g} {getattr(m.policy, g).mode} ({n:,})" for g, n in counts.items())
    return (f"{path}: ok\n"
            f"  model: {config.num_hidden_layers}-layer LM (hidden {config.hidden_size}) + ViT "
            f"{m.vision.num_hidden_layers} layers at {m.vision.image_size}px, cross-attention after layers "
            f"{list(m.cross_layers)}\n"
            f"  trainable: {groups}")
