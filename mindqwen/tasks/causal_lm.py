"""A causal-LM recipe end to end: data → model → (pre-train) → eval → LoRA → fit → eval → export.

Every stage writes into ``trainer.output_dir``; ``summary.json`` there lists the figures and where
the outputs are.
"""
from __future__ import annotations

import dataclasses
import json
import os
from contextlib import nullcontext
from typing import Optional

import mindspore as ms

from mindqwen.data.sources import load_pretrain, load_split
from mindqwen.data.tokenizer import SentencePieceTokenizer
from mindqwen.evaluate import exact_match
from mindqwen.export import export_model
from mindqwen.io.hf import no_init_parameters
from mindqwen.lora import apply_lora, is_target, load_adapter
from mindqwen.models.moe import ExpertLinear
from mindqwen.models.layers import Linear
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.tasks import finish_run
from mindqwen.train.distributed import check_model_layout
from mindqwen.train.loop import fit
from mindqwen.train.model import build_model
from mindqwen.train.recipe import DataSection, Recipe, RecipeError
from mindqwen.train.validate import (check_eval, check_export_section, check_numerics, check_outputs,
                                     recipe_model_config, tiny_config)

SAMPLES = 4  # generated answers printed and kept in the summary


class CausalLMTask:
    """Next-token training of a Qwen model (full weights or LoRA) on text or prompt/response data."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    # ------------------------------------------------------------------ data and model
    def data(self) -> DataSection:
        """The recipe's data section; the letters demo's (``data.synthetic``) points at the files
        its run writes into ``<output_dir>/data``."""
        d = self.recipe.data
        if d.synthetic is None:
            return d
        folder = os.path.join(self.recipe.trainer.output_dir, "data")
        paths = {k: os.path.join(folder, f"{k}.jsonl") for k in ("train", "eval", "pretrain")}
        return dataclasses.replace(d, **paths, tokenizer=os.path.join(folder, "tokenizer.model"), synthetic=None)

    def tokenizer_file(self) -> Optional[str]:
        return self.data().tokenizer

    def build(self, tokenizer: Optional[SentencePieceTokenizer]) -> QwenForCausalLM:
        """The model a run starts from (a checkpoint, or random weights sized to ``tokenizer``).
        Sample boundaries (``data.reset_positions``) travel with the data, as ``position_ids``."""
        return build_model(self.recipe.model, tokenizer.vocab_size if tokenizer else None)

    # ------------------------------------------------------------------ train
    def train(self, recipe_text: Optional[str] = None) -> dict:
        recipe = self.recipe
        out = recipe.trainer.output_dir
        if recipe.data.synthetic is not None:
            from mindqwen.demos.letters import write_letters
            write_letters(recipe.data.synthetic, os.path.join(out, "data"))
        data = self.data()
        tokenizer = SentencePieceTokenizer(data.tokenizer) if data.tokenizer else None
        train_set, _ = load_split(data.train, tokenizer, data.seq_length, reset_positions=data.reset_positions)
        eval_set, eval_pairs = load_split(data.eval, tokenizer, data.seq_length, reset_positions=data.reset_positions)
        ms.set_seed(recipe.trainer.seed)
        model = self.build(tokenizer)
        summary = {"output_dir": out}
        if recipe.pretrain is not None:
            summary["pretrain"] = self._pretrain(model, data, tokenizer)
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
        return finish_run(self, model, summary)

    def _pretrain(self, model: QwenForCausalLM, data: DataSection, tokenizer) -> dict:
        """The ``pretrain`` stage: full weights on ``data.pretrain``, into ``<output_dir>/pretrain``."""
        recipe, p = self.recipe, self.recipe.pretrain
        corpus = load_pretrain(data.pretrain, tokenizer, data.seq_length, reset_positions=data.reset_positions)
        stage = dataclasses.replace(recipe.trainer, max_steps=p.max_steps, micro_batch_size=p.micro_batch_size,
                                    lr=p.lr, warmup_steps=p.warmup_steps, schedule=p.schedule, gradient_accumulation=1,
                                    resume=None, output_dir=os.path.join(recipe.trainer.output_dir, "pretrain"))
        print(f"pre-training from scratch: {p.max_steps} steps on {len(corpus)} rows of {data.seq_length} tokens")
        return fit(model, corpus, stage, parallel=recipe.parallel)

    def trained_model(self) -> QwenForCausalLM:
        """``model/`` (full fine-tune), or the base (the checkpoint, or ``pretrain/model``) with ``adapter/``."""
        recipe = self.recipe
        out = recipe.trainer.output_dir
        if recipe.lora is None:
            return QwenForCausalLM.from_pretrained(os.path.join(out, "model"))
        base = os.path.join(out, "pretrain", "model") if recipe.pretrain is not None else recipe.model.checkpoint
        if base is None:
            raise ValueError("this recipe trains LoRA on random weights that no run saves: there is no base model "
                             "to export (give model.checkpoint, or a pretrain stage)")
        return load_adapter(QwenForCausalLM.from_pretrained(base, recipe.model.dtype), os.path.join(out, "adapter"))

    # ------------------------------------------------------------------ export
    def export(self, model: QwenForCausalLM, folder: str) -> dict:
        """MindIR prefill + decode graphs with the recipe's ``export`` and ``generation`` sections."""
        e, g = self.recipe.export, self.recipe.generation
        tokenizer_file = self.tokenizer_file()
        generation = dataclasses.asdict(g)
        for derived in ("eos_ids", "pad_id"):
            del generation[derived]
        if tokenizer_file is not None:
            generation["eos_token_id"] = SentencePieceTokenizer(tokenizer_file).eos_token_id
        manifest = export_model(model, folder, e.batch_sizes, e.max_seq_len, e.seq_buckets, e.dtype, e.soc_version,
                                e.precision_mode, tokenizer_files=[tokenizer_file] if tokenizer_file else [],
                                generation=generation)
        with open(os.path.join(folder, "parity.json"), encoding="utf-8") as f:
            parity = json.load(f)
        files = " + ".join(g["file"] for g in manifest["graphs"].values())
        print(f"exported {folder}: {files}, lite/ configs for {e.soc_version}; exported graphs vs eager steps: "
              f"max |Δlogit| = {parity['eager_same_steps']['max_abs_logit_diff']:.1e}, "
              f"vs full recompute {parity['full_recompute']['max_abs_logit_diff']:.1e}")
        return {"folder": folder, **{k: parity[k] for k in ("eager_same_steps", "full_recompute", "passed")}}

    # ------------------------------------------------------------------ validate
    def validate(self, source: str, tiny: bool = False) -> str:
        recipe = self.recipe
        check_outputs(recipe, source)
        check_eval(recipe, source, self.tokenizer_file())
        if tiny and recipe.model.checkpoint:
            recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, checkpoint=None))
            if not (recipe.model.preset or recipe.model.config):
                raise RecipeError(f"{source}: --tiny needs model.preset (the architecture) when "
                                  "model.checkpoint is set")
        config = recipe_model_config(recipe, source)
        check_numerics(recipe, config, source, None if tiny else ms.get_context("device_target"))
        check_export_section(recipe, config, source)
        if tiny:
            if recipe.data.synthetic is None and recipe.data.train is None:
                raise RecipeError(f"{source}: data.train is required (or data.synthetic for generated data)")
            data = "not read (--tiny)"
        else:  # the model's vocabulary follows the tokenizer unless a checkpoint or config fixes it
            fixed_vocab = recipe.model.checkpoint or recipe.model.preset or "vocab_size" in recipe.model.config
            data = check_data(recipe, source, config.vocab_size if fixed_vocab else None)
        try:
            check_model_layout(config, recipe.parallel, recipe.lora.r if recipe.lora is not None else 0)
        except ValueError as e:
            raise RecipeError(f"{source}: parallel: {e}") from None
        built = tiny_config(config) if tiny else config
        with nullcontext() if tiny else no_init_parameters():  # a full-size build allocates nothing
            model = QwenForCausalLM(built)
        training = check_lora(recipe, model, source, tiny)
        p = recipe.parallel
        experts = f" (experts split {p.expert_parallel} ways)" if p.expert_parallel > 1 else ""
        built_note = f" (built tiny: {built.num_hidden_layers} layers, hidden {built.hidden_size})" if tiny else ""
        return (f"{source}: ok\n"
                f"  model: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}{built_note}\n"
                f"  data: {data}\n"
                f"  training: {training}\n"
                f"  parallel: dp {p.data_parallel}{experts} × tp {p.tensor_parallel} × pp {p.pipeline_parallel} = "
                f"{p.devices} devices")


def check_lora(recipe: Recipe, model: QwenForCausalLM, source: str, tiny: bool) -> str:
    """``lora.target_modules`` against ``model``'s modules (applied, when ``tiny``); returns what trains."""
    total = sum(p.size for p in model.get_parameters())
    if recipe.lora is None:
        return "full fine-tune"
    try:
        if tiny:
            apply_lora(model, recipe.lora)
        elif not any([is_target(recipe.lora, name, cell) for name, cell in model.cells_and_names()
                      if isinstance(cell, (Linear, ExpertLinear))]):  # every module: a partial expert match raises
            raise ValueError(f"target_modules={recipe.lora.target_modules!r} matches no module")
    except ValueError as e:
        raise RecipeError(f"{source}: lora.target_modules: {e}") from None
    if tiny:
        trainable = sum(q.size for q in model.trainable_params())
        return f"LoRA r={recipe.lora.r}, {trainable:,} of {total:,} parameters trainable as built"
    return f"LoRA r={recipe.lora.r} on {total:,} parameters"


def check_data(recipe: Recipe, source: str, vocab_size: Optional[int]) -> str:
    """Read every data file as ``train`` will (shapes, token ids, records); returns a summary.

    Raises:
        RecipeError: naming the recipe, the key and the file (and line).
    """
    d = recipe.data
    if d.synthetic is not None:
        given = [k for k in ("train", "eval", "pretrain", "tokenizer") if getattr(d, k) is not None]
        if given:
            raise RecipeError(f"{source}: data.{given[0]} is set, but data.synthetic writes its own data and tokenizer; "
                              f"remove one of them")
        return f"synthetic ({d.synthetic.train_examples} train, {d.synthetic.eval_examples} eval examples)"
    if d.train is None:
        raise RecipeError(f"{source}: data.train is required (or data.synthetic for generated data)")
    if recipe.pretrain is not None and d.pretrain is None:
        raise RecipeError(f"{source}: pretrain needs data.pretrain (.txt text or .jsonl pairs)")
    for key in ("train", "eval", "pretrain", "tokenizer"):
        value = getattr(d, key)
        if value is not None and not os.path.exists(value):
            raise RecipeError(f"{source}: data.{key}: {value} not found")
    key = "tokenizer"
    try:
        tokenizer = SentencePieceTokenizer(d.tokenizer) if d.tokenizer else None
        if tokenizer is not None and vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise ValueError(f"{d.tokenizer} has {tokenizer.vocab_size} tokens, the model's vocab_size is {vocab_size}")
        if vocab_size is None and tokenizer is not None:  # the model is built with the tokenizer's
            vocab_size = tokenizer.vocab_size
        sizes = {}
        for key in ("train", "eval"):
            sizes[key] = len(load_split(getattr(d, key), tokenizer, d.seq_length, vocab_size,
                                        d.reset_positions)[0] or ())
        if recipe.pretrain is not None:
            key = "pretrain"
            sizes[key] = len(load_pretrain(d.pretrain, tokenizer, d.seq_length, vocab_size, d.reset_positions))
    except (ValueError, OSError, RuntimeError) as e:
        raise RecipeError(f"{source}: data.{key}: {e}") from None
    t = recipe.trainer
    batch = t.micro_batch_size * t.gradient_accumulation * recipe.parallel.data_parallel
    if sizes["train"] < batch:
        raise RecipeError(f"{source}: data.train: {sizes['train']} examples, fewer than one global batch "
                          f"(micro_batch_size × gradient_accumulation × data_parallel = {batch})")
    return ", ".join(f"{k} {n:,}" for k, n in sizes.items() if n) + f" rows of {d.seq_length} tokens"
