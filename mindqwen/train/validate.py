"""Recipe checks every task shares: the model section's config, the output folder, lengths and
dtypes against the model and device, the export section, keys a task does not read.

Each task (``mindqwen.tasks``) composes them with its own (data, adapters, the model it builds) in
its ``validate``, which ``mindqwen validate`` prints and ``mindqwen train`` runs before it builds
anything. ``tiny_config`` is the tiny model of the same architecture that ``--tiny`` builds, so
recipes for 7B–72B models validate in seconds on a laptop.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional


from mindqwen.config import QwenConfig
from mindqwen.train.precision import check_device_support
from mindqwen.train.model import model_config
from mindqwen.train.recipe import Recipe, RecipeError

# A tiny stand-in keeping the architecture's switches (qkv bias, q/k-norm, tying, GQA).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, vocab_size=256, max_position_embeddings=128)


def recipe_model_config(recipe: Recipe, path: str, vocab_size: Optional[int] = 256) -> QwenConfig:
    """The config the recipe trains (``mindqwen.train.model.model_config``), errors naming the key.

    Args:
        vocab_size: the tokenizer's, where neither checkpoint nor section fixes it (the default
            stands in for a demo tokenizer not trained yet).
    """
    m = recipe.model
    try:
        if m.checkpoint and not os.path.isfile(os.path.join(m.checkpoint, "config.json")):
            raise RecipeError(f"{path}: model.checkpoint: {m.checkpoint} is not an HF folder (no config.json)")
        if not (m.checkpoint or m.preset or m.config):
            raise RecipeError(f"{path}: model: give checkpoint, preset or config")
        return model_config(m, vocab_size)
    except RecipeError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        where = "model.checkpoint" if m.checkpoint else "model.preset" if m.preset else "model.config"
        raise RecipeError(f"{path}: {where}: {str(e).strip(chr(39))}") from None


def tiny_config(config: QwenConfig) -> QwenConfig:
    kv = 2 if config.num_key_value_heads < config.num_attention_heads else 4
    moe = {}
    if config.num_experts:  # a few small experts, the same routing switches
        moe = dict(num_experts=4, num_experts_per_tok=min(config.num_experts_per_tok, 2), moe_intermediate_size=32,
                   shared_expert_intermediate_size=64 if config.shared_expert_intermediate_size else 0,
                   mlp_only_layers=[i for i in config.mlp_only_layers if i < TINY["num_hidden_layers"]])
    hybrid = {}
    if config.is_hybrid:  # both layer kinds (linear attention, then full), small linear-attention heads
        hybrid = dict(full_attention_interval=TINY["num_hidden_layers"], linear_num_key_heads=2,
                      linear_num_value_heads=4 if config.linear_num_value_heads > config.linear_num_key_heads else 2,
                      linear_key_head_dim=16, linear_value_head_dim=16)
    return dataclasses.replace(config, **TINY, **moe, **hybrid, num_key_value_heads=kv, rope_scaling=None,
                               layer_types=None, sliding_window=None, use_sliding_window=False)


def check_outputs(recipe: Recipe, path: str) -> None:
    """``output_dir`` (and a resume checkpoint) can be used: never a file, and writable."""
    out = recipe.trainer.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"{path}: trainer.output_dir: {out} is a file, not a folder")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise RecipeError(f"{path}: trainer.output_dir: cannot create or write {out} ({parent} is not a writable folder)")
    resume = recipe.trainer.resume
    if resume not in (None, "auto") and not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise RecipeError(f"{path}: trainer.resume: {resume} is not a complete mindqwen checkpoint "
                          "(no trainer_state.json); use auto for the newest in output_dir")


def eval_tokenizer(recipe: Recipe, tokenizer_file: Optional[str]) -> Optional[str]:
    """The tokenizer the ``eval`` section's benchmarks read text with: the recipe's own, else the
    one in the ``model.checkpoint`` folder; None when there is neither."""
    from mindqwen.data.tokenizer import TOKENIZER_FILES
    checkpoint = recipe.model.checkpoint
    if tokenizer_file is None and checkpoint and os.path.isdir(checkpoint) and any(
            os.path.isfile(os.path.join(checkpoint, f)) for f in TOKENIZER_FILES):
        return checkpoint
    return tokenizer_file


def check_eval(recipe: Recipe, path: str, tokenizer_file: Optional[str]) -> None:
    """The ``eval`` section can run after training: lm-evaluation-harness is installed, its tasks
    exist (and ``include_path``), and there is a tokenizer (``eval_tokenizer``)."""
    if recipe.eval is None:
        return
    try:
        from mindqwen.harness import check_tasks
    except ImportError as e:
        raise RecipeError(f"{path}: eval: {e}") from None
    try:
        check_tasks(recipe.eval.tasks, recipe.eval.include_path, recipe.eval.limit)
    except ValueError as e:
        raise RecipeError(f"{path}: eval: {e}") from None
    if eval_tokenizer(recipe, tokenizer_file) is None:
        raise RecipeError(f"{path}: eval: benchmarks are text: give data.tokenizer, or a model.checkpoint folder "
                          "with its tokenizer")


def check_numerics(recipe: Recipe, config: QwenConfig, path: str, device: Optional[str]) -> None:
    """Lengths against the model; dtypes against ``device`` (None: the recipe's target is not here)."""
    d = recipe.data
    if d.seq_length > config.context_length:
        raise RecipeError(f"{path}: data.seq_length={d.seq_length} exceeds the model's {config.context_length} "
                          f"positions ({config.context_rule})")
    if device is None:
        return
    if recipe.model.dtype == "bfloat16" and device == "CPU":
        raise RecipeError(f"{path}: model.dtype: bfloat16 cannot compute on CPU (MindSpore has no bf16 CPU "
                          "kernels); use float32 here, bfloat16 on Ascend")
    try:
        check_device_support(recipe.trainer.precision, device)
    except ValueError as e:
        raise RecipeError(f"{path}: trainer.precision: {e}") from None


def check_export_section(recipe: Recipe, config: QwenConfig, path: str, dtype: Optional[str] = None) -> None:
    """The export that runs after training, checked as it will be (``dtype``: the one it uses)."""
    from mindqwen.export.mindir import check_export, default_buckets
    e = recipe.export
    if not e.enabled:
        return
    try:
        check_export(config, e.batch_sizes, e.max_seq_len, sorted(set(e.seq_buckets or default_buckets(e.max_seq_len))),
                     dtype or e.dtype, e.soc_version, e.precision_mode, ())
    except ValueError as err:
        raise RecipeError(f"{path}: export: {err}") from None


def check_unused(recipe: Recipe, unused: Dict[str, str]) -> List[str]:
    """The keys of ``unused`` (dotted recipe keys → why the task does not read them) that
    ``recipe`` sets to something other than their default, each with its reason."""
    found = []
    for key, why in unused.items():
        owner, name = recipe, key
        for part in key.split(".")[:-1]:
            owner = getattr(owner, part)
        name = key.split(".")[-1]
        default = next(f for f in dataclasses.fields(owner) if f.name == name).default
        if getattr(owner, name) != default:
            found.append(f"{key} ({why})")
    return found
