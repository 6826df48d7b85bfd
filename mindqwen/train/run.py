"""A recipe, run end to end: data → model → (pre-train) → eval → LoRA → fit → eval → export.

``mindqwen train <recipe>`` calls :func:`train_recipe`. Every stage writes into
``trainer.output_dir``; ``summary.json`` there lists the figures and where the outputs are.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import mindspore as ms

from mindqwen import backend
from mindqwen.data.instruct import write_pairs
from mindqwen.data.sources import load_pretrain, load_split
from mindqwen.data.synthetic import make_demo_data
from mindqwen.data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from mindqwen.evaluate import exact_match
from mindqwen.export import export_model
from mindqwen.io.jsonfile import write_json
from mindqwen.lora import apply_lora, load_adapter
from mindqwen.models.qwen import QwenForCausalLM, set_document_boundaries
from mindqwen.train.loop import fit
from mindqwen.train.model import build_model
from mindqwen.train.recipe import DataSection, Recipe
from mindqwen.train.validate import check_recipe

SAMPLES = 4  # generated answers printed and kept in the summary


def materialise_synthetic(data: DataSection, folder: str) -> DataSection:
    """Write the demo data and its tokenizer into ``folder``; returns the section pointing at them."""
    s = data.synthetic
    demo = make_demo_data(s.seed, s.pretrain_examples, s.train_examples, s.eval_examples, s.alphabet)
    os.makedirs(folder, exist_ok=True)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("pretrain", "train", "eval")}
    for name, pairs in (("pretrain", demo.pretrain), ("train", demo.train), ("eval", demo.eval)):
        write_pairs(pairs, paths[name])
    tokenizer = os.path.join(folder, "tokenizer.model")
    train_sentencepiece([p + r for p, r in demo.pretrain + demo.train], tokenizer, s.vocab_size)
    return dataclasses.replace(data, train=paths["train"], eval=paths["eval"], pretrain=paths["pretrain"],
                               tokenizer=tokenizer, synthetic=None)


def train_recipe(recipe: Recipe, recipe_text: Optional[str] = None, source: str = "recipe") -> dict:
    """Check ``recipe`` as ``mindqwen validate`` does, then run it; returns (and writes as
    ``summary.json``) its figures and output paths. ``source`` names the recipe in errors."""
    check_recipe(recipe, source)
    if recipe.trainer.compile_cache:  # MindSpore cannot cache fused graphs (train/compile_cache.py)
        backend.disable_cpu_fusion()
    if recipe.multimodal is not None:
        from mindqwen.train.run_multimodal import train_multimodal_recipe
        return train_multimodal_recipe(recipe, recipe_text)
    out = recipe.trainer.output_dir
    data = recipe.data
    if data.synthetic is not None:
        data = materialise_synthetic(data, os.path.join(out, "data"))
    tokenizer = SentencePieceTokenizer(data.tokenizer) if data.tokenizer else None
    train_set, _ = load_split(data.train, tokenizer, data.seq_length)
    eval_set, eval_pairs = load_split(data.eval, tokenizer, data.seq_length)
    ms.set_seed(recipe.trainer.seed)
    model = build_model(recipe.model, tokenizer.vocab_size if tokenizer else None)
    if data.reset_positions:
        eos = tokenizer.eos_token_id if tokenizer else model.config.eos_token_id
        if not isinstance(eos, int):
            raise ValueError("data.reset_positions needs the EOS id: give data.tokenizer (or a config eos_token_id)")
        set_document_boundaries(model, eos)
    summary = {"output_dir": out}

    if recipe.pretrain is not None:
        corpus = load_pretrain(data.pretrain, tokenizer, data.seq_length)
        p = recipe.pretrain
        stage = dataclasses.replace(recipe.trainer, max_steps=p.max_steps, micro_batch_size=p.micro_batch_size,
                                    lr=p.lr, warmup_steps=p.warmup_steps, schedule=p.schedule,
                                    gradient_accumulation=1, resume=None, output_dir=os.path.join(out, "pretrain"))
        print(f"pre-training from scratch: {p.max_steps} steps on {len(corpus)} rows of {data.seq_length} tokens")
        summary["pretrain"] = fit(model, corpus, stage, parallel=recipe.parallel)

    max_new = 1 + max((len(tokenizer.encode(r)) for _, r in eval_pairs), default=0)
    if eval_pairs:
        summary["exact_match_before"], _ = exact_match(model, tokenizer, eval_pairs, max_new)
        print(f"held-out exact match before fine-tuning: {summary['exact_match_before']:.1%} "
              f"({len(eval_pairs)} questions)")
    if recipe.lora is not None:
        model = apply_lora(model, recipe.lora)
    summary["train"] = fit(model, train_set, recipe.trainer, eval_set, recipe_text, recipe.parallel)

    if eval_pairs:
        summary["exact_match_after"], answers = exact_match(model, tokenizer, eval_pairs, max_new)
        print(f"held-out exact match after fine-tuning:  {summary['exact_match_after']:.1%}")
        summary["samples"] = [{"prompt": p, "answer": a, "reference": r}
                              for (p, r), a in zip(eval_pairs[:SAMPLES], answers)]
        for s in summary["samples"]:
            print(f"  {s['prompt']}{s['answer']}   (reference:{s['reference']})")
    if recipe.export.enabled:
        summary["export"] = export_recipe_model(model, recipe, data, tokenizer, os.path.join(out, "export"))
    write_json(os.path.join(out, "summary.json"), summary)
    return summary


def export_recipe(recipe: Recipe, folder: Optional[str] = None) -> dict:
    """``mindqwen export <recipe>``: export what a finished run of ``recipe`` trained, with its
    ``export`` and ``generation`` sections, into ``folder`` (default ``<output_dir>/export``)."""
    folder = folder or os.path.join(recipe.trainer.output_dir, "export")
    if recipe.multimodal is not None:
        from mindqwen.train import run_multimodal
        return run_multimodal.export_recipe_model(run_multimodal.trained_model(recipe), recipe, folder)
    data = recipe.data
    if data.synthetic is not None:
        data = dataclasses.replace(data, tokenizer=os.path.join(recipe.trainer.output_dir, "data", "tokenizer.model"))
    tokenizer = SentencePieceTokenizer(data.tokenizer) if data.tokenizer else None
    return export_recipe_model(trained_model(recipe), recipe, data, tokenizer, folder)


def trained_model(recipe: Recipe) -> QwenForCausalLM:
    """The text model a finished run of ``recipe`` left in its output folder: ``model/`` (full
    fine-tune), or its base (the checkpoint, or ``pretrain/model``) with ``adapter/``."""
    out = recipe.trainer.output_dir
    if recipe.lora is None:
        return QwenForCausalLM.from_pretrained(os.path.join(out, "model"))
    base = os.path.join(out, "pretrain", "model") if recipe.pretrain is not None else recipe.model.checkpoint
    if base is None:
        raise ValueError("this recipe trains LoRA on random weights that no run saves: there is no base model "
                         "to export (give model.checkpoint, or a pretrain stage)")
    return load_adapter(QwenForCausalLM.from_pretrained(base, recipe.model.dtype), os.path.join(out, "adapter"))


def export_recipe_model(model: QwenForCausalLM, recipe: Recipe, data: DataSection, tokenizer,
                        folder: str) -> dict:
    """Export with the recipe's ``export`` and ``generation`` sections; returns the parity figures."""
    e, g = recipe.export, recipe.generation
    generation = dataclasses.asdict(g)
    for derived in ("eos_ids", "pad_id"):
        del generation[derived]
    if tokenizer is not None:
        generation["eos_token_id"] = tokenizer.eos_token_id
    manifest = export_model(model, folder, e.batch_sizes, e.max_seq_len, e.seq_buckets, e.dtype, e.soc_version,
                            e.precision_mode, tokenizer_files=[data.tokenizer] if data.tokenizer else [],
                            generation=generation)
    with open(os.path.join(folder, "parity.json"), encoding="utf-8") as f:
        parity = json.load(f)
    files = " + ".join(g["file"] for g in manifest["graphs"].values())
    print(f"exported {folder}: {files}, lite/ configs for {e.soc_version}; "
          f"exported graphs vs eager steps: max |Δlogit| = {parity['eager_same_steps']['max_abs_logit_diff']:.1e}, "
          f"vs full recompute {parity['full_recompute']['max_abs_logit_diff']:.1e}")
    return {"folder": folder, **{k: parity[k] for k in ("eager_same_steps", "full_recompute", "passed")}}
