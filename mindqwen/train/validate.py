"""``mindqwen validate``: everything about a recipe that can be checked without training.

Type checks, finiteness, ranges and duplicate keys (``load_recipe``); required fields; the output
folder; every data file read as training reads it (shapes against ``seq_length``, token ids
against the vocabulary, records by line); ``seq_length`` against the model's positions; dtypes
against the device; the model's shape against the parallel layout; LoRA targets against the
model's modules; and a model build. ``mindqwen train`` runs the same ``check_recipe`` before it
builds anything. ``tiny=True`` replaces the checkpoint by a tiny random model of the same
architecture (and skips data checks), so recipes for 7B–72B models validate in seconds on a laptop.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import nullcontext
from typing import List, Optional, Sequence

import mindspore as ms

from mindqwen.config import QwenConfig
from mindqwen.data.sources import load_pretrain, load_split
from mindqwen.data.tokenizer import SentencePieceTokenizer
from mindqwen.io.hf import no_init_parameters
from mindqwen.lora import apply_lora, is_target
from mindqwen.models.qwen import ExpertLinear, Linear, QwenForCausalLM
from mindqwen.train.distributed import check_model_layout
from mindqwen.train.precision import check_device_support
from mindqwen.train.model import model_config
from mindqwen.train.recipe import Recipe, RecipeError, load_recipe

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
    return dataclasses.replace(config, **TINY, **moe, num_key_value_heads=kv, rope_scaling=None,
                               layer_types=None, sliding_window=None, use_sliding_window=False)


def check_data(recipe: Recipe, path: str, vocab_size: Optional[int]) -> str:
    """Read every data file as ``train`` will (shapes, token ids, records); returns a summary.

    Raises:
        RecipeError: naming the recipe, the key and the file (and line).
    """
    d = recipe.data
    if d.synthetic is not None:
        given = [k for k in ("train", "eval", "pretrain", "tokenizer") if getattr(d, k) is not None]
        if given:
            raise RecipeError(f"{path}: data.{given[0]} is set, but data.synthetic writes its own data and tokenizer; "
                              f"remove one of them")
        return f"synthetic ({d.synthetic.train_examples} train, {d.synthetic.eval_examples} eval examples)"
    if d.train is None:
        raise RecipeError(f"{path}: data.train is required (or data.synthetic for generated data)")
    if recipe.pretrain is not None and d.pretrain is None:
        raise RecipeError(f"{path}: pretrain needs data.pretrain (.txt text or .jsonl pairs)")
    for key in ("train", "eval", "pretrain", "tokenizer"):
        value = getattr(d, key)
        if value is not None and not os.path.exists(value):
            raise RecipeError(f"{path}: data.{key}: {value} not found")
    key = "tokenizer"
    try:
        tokenizer = SentencePieceTokenizer(d.tokenizer) if d.tokenizer else None
        if tokenizer is not None and vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ValueError(f"{d.tokenizer} has {tokenizer.vocab_size} tokens, the model's vocab_size is {vocab_size}")
        if vocab_size is None and tokenizer is not None:  # the model is built with the tokenizer's
            vocab_size = tokenizer.vocab_size
        sizes = {}
        for key in ("train", "eval"):
            sizes[key] = len(load_split(getattr(d, key), tokenizer, d.seq_length, vocab_size)[0] or ())
        if recipe.pretrain is not None:
            key = "pretrain"
            sizes[key] = len(load_pretrain(d.pretrain, tokenizer, d.seq_length, vocab_size))
    except (ValueError, OSError, RuntimeError) as e:
        raise RecipeError(f"{path}: data.{key}: {e}") from None
    t = recipe.trainer
    batch = t.micro_batch_size * t.gradient_accumulation * recipe.parallel.data_parallel
    if sizes["train"] < batch:
        raise RecipeError(f"{path}: data.train: {sizes['train']} examples, fewer than one global batch "
                          f"(micro_batch_size × gradient_accumulation × data_parallel = {batch})")
    return ", ".join(f"{k} {n:,}" for k, n in sizes.items() if n) + f" rows of {d.seq_length} tokens"


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


def check_numerics(recipe: Recipe, config: QwenConfig, path: str, device: Optional[str]) -> None:
    """Lengths against the model; dtypes against ``device`` (None: the recipe's target is not here)."""
    d = recipe.data
    if d.seq_length > config.max_position_embeddings:
        raise RecipeError(f"{path}: data.seq_length={d.seq_length} exceeds the model's max_position_embeddings="
                          f"{config.max_position_embeddings}")
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


def check_recipe(recipe: Recipe, path: str, tiny: bool = False) -> str:
    """Everything ``train`` would otherwise fail on later; returns a short report.

    ``mindqwen train`` runs this before it builds anything. Raises RecipeError (one line, naming
    the file and key).
    """
    if recipe.multimodal is not None:
        return validate_multimodal(recipe, path, tiny)
    check_outputs(recipe, path)
    if tiny and recipe.model.checkpoint:
        recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, checkpoint=None))
        if not (recipe.model.preset or recipe.model.config):
            raise RecipeError(f"{path}: --tiny needs model.preset (the architecture) when model.checkpoint is set")
    config = recipe_model_config(recipe, path)
    check_numerics(recipe, config, path, None if tiny else ms.get_context("device_target"))
    check_export_section(recipe, config, path)
    if tiny:
        if recipe.data.synthetic is None and recipe.data.train is None:
            raise RecipeError(f"{path}: data.train is required (or data.synthetic for generated data)")
        data = "not read (--tiny)"
    else:  # the model's vocabulary follows the tokenizer unless a checkpoint or config fixes it
        fixed_vocab = recipe.model.checkpoint or recipe.model.preset or "vocab_size" in recipe.model.config
        data = check_data(recipe, path, config.vocab_size if fixed_vocab else None)
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
            elif not any([is_target(recipe.lora, name, cell) for name, cell in model.cells_and_names()
                          if isinstance(cell, (Linear, ExpertLinear))]):  # every module: a partial expert match raises
                raise ValueError(f"target_modules={recipe.lora.target_modules!r} matches no module")
        except ValueError as e:
            raise RecipeError(f"{path}: lora.target_modules: {e}") from None
    total = sum(p.size for p in model.get_parameters())
    p = recipe.parallel
    experts = f" (experts split {p.expert_parallel} ways)" if p.expert_parallel > 1 else ""
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
            f"  data: {data}\n"
            f"  training: {training}\n"
            f"  parallel: dp {p.data_parallel}{experts} × tp {p.tensor_parallel} × pp {p.pipeline_parallel} = {p.devices} devices")


def validate_recipe(path: str, overrides: Sequence[str] = (), tiny: bool = False) -> str:
    """``mindqwen validate``: load ``path`` with ``overrides`` and check it; returns the report."""
    return check_recipe(load_recipe(path, overrides), path, tiny)


def multimodal_conflicts(recipe: Recipe) -> List[str]:
    """Recipe keys a multimodal recipe cannot use, each with the reason."""
    d, p, m = recipe.data, recipe.parallel, recipe.multimodal
    demo = m.shapes is not None
    conflicts = {
        "lora": (recipe.lora is not None, "LoRA is set per group in multimodal.policy"),
        "pretrain": (recipe.pretrain is not None, "the LM's stage on the captions is multimodal.text_steps"),
        "data.pretrain / synthetic": (d.pretrain is not None or d.synthetic is not None,
                                      "multimodal data is image-text JSONL in data.train / data.eval"),
        "data.train / eval / tokenizer": (demo and any(getattr(d, k) is not None for k in ("train", "eval", "tokenizer")),
                                          "multimodal.shapes writes its own images, captions and tokenizer; "
                                          "multimodal.shapes=null trains on the files"),
        "multimodal.vision_steps": (not demo and m.vision_steps > 0,
                                    "the ViT's pre-training stage learns the shapes demo's colour/shape/place "
                                    "labels; on files the encoder comes trained (vision_steps=0)"),
        "data.reset_positions": (d.reset_positions, "a caption row holds one document"),
        "parallel": (p.devices > 1, "the layouts (data, tensor, pipeline) cover the LM alone, not the vision tower "
                                    "and cross-attention: multimodal recipes run on one device"),
    }
    return [f"{key} ({why})" for key, (used, why) in conflicts.items() if used]


def multimodal_image_id(recipe: Recipe, path: str) -> int:
    """The ``<image>`` token id of a multimodal recipe: past the shapes demo's pieces, or the
    tokenizer's (``mindqwen.multimodal.data.image_token_id``)."""
    from mindqwen.data.tokenizer import load_tokenizer
    from mindqwen.multimodal.data import image_token_id
    m, d = recipe.multimodal, recipe.data
    if m.shapes is not None:
        return m.shapes.vocab_size
    if d.train is None or d.tokenizer is None:
        raise RecipeError(f"{path}: data.train and data.tokenizer are required (image-text JSONL and its "
                          "tokenizer), or multimodal.shapes for the demo's data")
    try:
        return image_token_id(load_tokenizer(d.tokenizer))
    except (OSError, ValueError, KeyError) as e:
        raise RecipeError(f"{path}: data.tokenizer: {e}") from None


def validate_multimodal(recipe: Recipe, path: str, tiny: bool = False) -> str:
    """Check a multimodal recipe, read its data (unless ``tiny``) and build the fused model it
    trains with its group policies."""
    from mindqwen.multimodal.data import read_media_jsonl
    from mindqwen.multimodal.fusion import MultimodalQwen, apply_multimodal_lora, trainable_by_group
    m, d = recipe.multimodal, recipe.data
    check_outputs(recipe, path)
    conflicts = multimodal_conflicts(recipe)
    if conflicts:
        raise RecipeError(f"{path}: a multimodal recipe cannot use {'; '.join(conflicts)}")
    image_id = multimodal_image_id(recipe, path)
    config = recipe_model_config(recipe, path, image_id + 1)  # the pieces, then <image>
    if image_id >= config.vocab_size:
        raise RecipeError(f"{path}: model.config.vocab_size={config.vocab_size} has no id for <image> "
                          f"({image_id}: after the tokenizer's pieces)")
    check_numerics(recipe, config, path, None if tiny else ms.get_context("device_target"))
    check_export_section(recipe, config, path, "float32")  # image-conditioned graphs export in fp32
    data = "the shapes demo's, written at train time" if m.shapes is not None else "not read (--tiny)"
    if m.shapes is None and not tiny:
        from mindqwen.data.tokenizer import load_tokenizer
        tokenizer, counts = load_tokenizer(d.tokenizer), []
        for key in ("train", "eval"):
            if getattr(d, key) is not None:
                try:
                    rows = read_media_jsonl(getattr(d, key), tokenizer, image_id, d.seq_length, m.vision, m.template,
                                            d.skip_bad, d.workers, d.read_workers, recipe.trainer.progress)[0]
                except (OSError, ValueError) as e:
                    raise RecipeError(f"{path}: data.{key}: {e}") from None
                counts.append(f"{key} {len(rows):,} records")
        data = ", ".join(counts) + " (every image checked)"
    with no_init_parameters():  # the LM's shape matters here, not its weights
        lm = QwenForCausalLM(config)
    try:
        model = MultimodalQwen(lm, m.vision, m.cross_layers, image_id)
    except ValueError as e:
        raise RecipeError(f"{path}: multimodal: {e}") from None
    try:
        apply_multimodal_lora(model, m.policy)
    except ValueError as e:
        raise RecipeError(f"{path}: multimodal.policy: {e}") from None
    counts = trainable_by_group(model)
    groups = ", ".join(f"{g} {getattr(m.policy, g).mode} ({n:,})" for g, n in counts.items())
    t = recipe.trainer
    return (f"{path}: ok\n"
            f"  model: {config.num_hidden_layers}-layer LM (hidden {config.hidden_size}) + ViT "
            f"{m.vision.num_hidden_layers} layers at {m.vision.image_size}px, cross-attention after layers "
            f"{list(m.cross_layers)}\n"
            f"  data: {data}\n"
            f"  trainable: {groups}\n"
            f"  training: text {m.text_steps} + vision {m.vision_steps} + fused {t.max_steps} steps, "
            f"precision {t.precision.level}, recompute {t.recompute}, accumulation {t.gradient_accumulation}")
