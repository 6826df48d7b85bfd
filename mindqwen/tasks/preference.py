"""A preference recipe (a ``preference`` section): a causal LM learns to prefer the chosen response of
each pair over the rejected one (DPO, IPO, SimPO, ORPO: ``mindqwen.preference``).

data (pairs; the letters demo writes its own from ``data.synthetic``) → model (the checkpoint,
with ``model.adapter`` merged: the SFT stage's) → held-out preference accuracy and exact match
before → LoRA → the reference (the adapters off, a frozen copy, or log-probs computed once) →
fit with the preference loss → the same figures after → export.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Optional, Tuple

import mindspore as ms
import numpy as np

from mindqwen.data.loader import TokenDataset
from mindqwen.data.preference import load_pairs, pair_texts, read_pairs
from mindqwen.data.preprocess import load_packed
from mindqwen.data.tokenizer import load_tokenizer
from mindqwen.evaluate import exact_match
from mindqwen.io.atomic import atomic_file
from mindqwen.io.jsonfile import read_json, write_json
from mindqwen.lora import apply_lora, load_adapter
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.preference import (PreferenceLoss, frozen_copy, preference_accuracy, reference_view,
                                 sequence_log_probs)
from mindqwen.tasks.causal_lm import CausalLMTask, check_lora
from mindqwen.tasks import finish_run
from mindqwen.train.loop import fit
from mindqwen.train.model import build_model
from mindqwen.train.recipe import DataSection, Recipe, RecipeError
from mindqwen.train.validate import (check_eval, check_export_section, check_numerics, check_outputs,
                                     check_unused, recipe_model_config)

UNUSED = {
    "pretrain": "preference tuning starts from a trained model (model.checkpoint, model.adapter)",
    "data.pretrain": "preference data is pairs in data.train / data.eval",
    "data.reset_positions": "a pair's rows hold one conversation each",
}


class PreferenceTask:
    """Preference tuning of a Qwen model (LoRA or full weights) on chosen / rejected pairs."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.config = recipe.preference

    def data(self) -> DataSection:
        """The data section; the letters demo's pairs are written into ``<output_dir>/data``."""
        d = self.recipe.data
        if d.synthetic is None:
            return d
        folder = os.path.join(self.recipe.trainer.output_dir, "data")
        return dataclasses.replace(d, train=os.path.join(folder, "train.jsonl"),
                                   eval=os.path.join(folder, "eval.jsonl"), synthetic=None)

    def tokenizer_file(self) -> Optional[str]:
        return self.recipe.data.tokenizer

    def reference(self) -> Optional[str]:
        """Where the reference log-probs come from (None: the loss uses none)."""
        if not self.config.uses_reference:
            return None
        return self.config.reference or ("adapter_off" if self.recipe.lora is not None else "precompute")

    def _load(self, path: Optional[str], tokenizer) -> Tuple[Optional[TokenDataset], list]:
        """(rows, (prompt, chosen) texts for exact match) of one split."""
        if path is None:
            return None, []
        d = self.recipe.data
        if os.path.isdir(path):  # `mindqwen preprocess --kind preference`: no texts for exact match
            rows, manifest = load_packed(path)
            if manifest.get("kind") != "preference" or manifest.get("seq_length") != d.seq_length:
                raise ValueError(f"{path}: not preference pairs of seq_length {d.seq_length} (manifest: "
                                 f"{manifest.get('kind')}, {manifest.get('seq_length')})")
            return rows, []
        rows, dropped = load_pairs(path, tokenizer, d.seq_length, self.config.template, d.skip_bad)
        if dropped:
            print(f"{path}: {dropped} pairs left out (the prompt fills seq_length)")
        texts = [pair_texts(p, self.config.template)[:2] for _, p in read_pairs(path)]
        return rows, texts

    # ------------------------------------------------------------------ train
    def train(self, recipe_text: Optional[str] = None) -> dict:
        recipe, out = self.recipe, self.recipe.trainer.output_dir
        if recipe.data.synthetic is not None:
            from mindqwen.demos.letters import write_letter_pairs
            write_letter_pairs(recipe.data.synthetic, os.path.join(out, "data"))
        data = self.data()
        tokenizer = load_tokenizer(data.tokenizer)
        train_set, _ = self._load(data.train, tokenizer)
        eval_set, eval_texts = self._load(data.eval, tokenizer)
        ms.set_seed(recipe.trainer.seed)
        model = build_model(recipe.model, tokenizer.vocab_size)
        summary = {"output_dir": out}
        self._held_out(summary, "before", model, tokenizer, eval_set, eval_texts)
        if recipe.lora is not None:
            model = apply_lora(model, recipe.lora)
        reference = self._reference(model, train_set, eval_set)
        loss_net = PreferenceLoss(model, self.config, reference)
        summary["train"] = fit(model, train_set, recipe.trainer, eval_set, recipe_text, recipe.parallel,
                               loss_net=loss_net)
        self._held_out(summary, "after", model, tokenizer, eval_set, eval_texts)
        return finish_run(self, model, summary)

    def _held_out(self, summary: dict, when: str, model, tokenizer, eval_set, texts) -> None:
        """Held-out preference accuracy (the chosen response likelier per token) and exact match
        (the greedy answer is the chosen response) into ``summary``."""
        if eval_set is None:
            return
        summary[f"preference_accuracy_{when}"] = accuracy = preference_accuracy(model, eval_set)
        line = f"held-out preference accuracy {when} preference tuning: {accuracy:.1%}"
        if texts:  # pairs read from JSON lines (a preprocessed folder keeps no texts)
            max_new = 1 + max(len(tokenizer.encode(c)) for _, c in texts)
            summary[f"exact_match_{when}"], _ = exact_match(model, tokenizer, texts, max_new)
            line += f", exact match {summary[f'exact_match_{when}']:.1%}"
        print(f"{line} ({len(eval_set)} pairs)")

    def _reference(self, model: QwenForCausalLM, train_set: TokenDataset, eval_set: Optional[TokenDataset]):
        """The reference model beside the policy, or None (log-probs in the data, or no reference)."""
        kind = self.reference()
        if kind == "adapter_off":
            return reference_view(model)
        if kind == "model":
            return frozen_copy(build_model(self.recipe.model, model.config.vocab_size))
        if kind == "precompute":
            for name, split in (("train", train_set), ("eval", eval_set)):
                if split is not None:
                    split.reference_logps = self._precomputed(model, split, name)
        return None

    def _precomputed(self, model: QwenForCausalLM, data: TokenDataset, name: str) -> np.ndarray:
        """The reference log-probs of ``data`` under ``model`` as it is before training, computed
        once and kept in ``<output_dir>/reference/<name>.npy``, keyed on the weights and the data."""
        folder = os.path.join(self.recipe.trainer.output_dir, "reference")
        key = _digest(model, data)
        path, meta = os.path.join(folder, f"{name}.npy"), os.path.join(folder, f"{name}.json")
        if os.path.isfile(meta) and read_json(meta, ValueError, "reference key").get("key") == key:
            return np.load(path)
        view = reference_view(model) if any(not p.requires_grad for p in model.get_parameters()) else model
        print(f"reference log-probs of {len(data)} {name} pairs (once; kept in {folder})")
        logps = sequence_log_probs(view, data)[0]
        os.makedirs(folder, exist_ok=True)
        with atomic_file(path, ".npy") as tmp:  # np.save keeps a name ending in .npy
            np.save(tmp, logps)
        write_json(meta, {"key": key})
        return logps

    def trained_model(self) -> QwenForCausalLM:
        """``model/`` (full weights), or the starting model (checkpoint + ``model.adapter``) with ``adapter/``."""
        out = self.recipe.trainer.output_dir
        if self.recipe.lora is None:
            return QwenForCausalLM.from_pretrained(os.path.join(out, "model"))
        if self.recipe.model.checkpoint is None:
            raise ValueError("this recipe trains LoRA on random weights that no run saves: give model.checkpoint")
        return load_adapter(build_model(self.recipe.model), os.path.join(out, "adapter"))

    def export(self, model: QwenForCausalLM, folder: str) -> dict:
        return CausalLMTask(self.recipe).export(model, folder)

    # ------------------------------------------------------------------ validate
    def validate(self, source: str, tiny: bool = False) -> str:
        recipe = self.recipe
        check_outputs(recipe, source)
        check_eval(recipe, source, self.tokenizer_file())
        if tiny and recipe.model.checkpoint:  # the architecture from preset / config, as the causal LM's
            recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, checkpoint=None))
            if not (recipe.model.preset or recipe.model.config):
                raise RecipeError(f"{source}: --tiny needs model.preset (the architecture) when "
                                  "model.checkpoint is set")
        reasons = check_unused(recipe, UNUSED)
        if reasons:
            raise RecipeError(f"{source}: a preference recipe cannot use {'; '.join(reasons)}")
        if self.reference() == "adapter_off" and recipe.lora is None:
            raise RecipeError(f"{source}: preference.reference: adapter_off needs a lora section (a full fine-tune "
                              "has no adapters to switch off): use precompute or model")
        if recipe.data.tokenizer is None:
            raise RecipeError(f"{source}: data.tokenizer is required (preference data is text)")
        for key in ("tokenizer", "adapter"):
            path = getattr(recipe.data if key == "tokenizer" else recipe.model, key)
            if path is not None and not os.path.exists(path) and not tiny:
                raise RecipeError(f"{source}: {'data' if key == 'tokenizer' else 'model'}.{key}: {path} not found "
                                  + ("(the letters demo's: run recipes/demo/demo.yaml first)"
                                     if recipe.data.synthetic is not None else ""))
        config = recipe_model_config(recipe, source)
        check_numerics(recipe, config, source, None if tiny else ms.get_context("device_target"))
        check_export_section(recipe, config, source)
        data = "not read (--tiny)" if tiny else self._check_data(source, config.vocab_size)
        if tiny:
            from mindqwen.train.validate import tiny_config
            config = tiny_config(config)
        from mindqwen.io.hf import no_init_parameters
        with no_init_parameters():
            model = QwenForCausalLM(config)
        training = check_lora(recipe, model, source, False)
        c = self.config
        return (f"{source}: ok\n"
                f"  model: {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}\n"
                f"  data: {data}\n"
                f"  training: {training}; {c.loss_type} (beta {c.beta}), reference {self.reference() or 'none'}")

    def _check_data(self, source: str, vocab_size: int) -> str:
        """Read every pair as training will (records by line, the budget after each prompt)."""
        d = self.recipe.data
        if d.synthetic is not None:
            return f"the letters demo's pairs ({d.synthetic.train_examples} train, {d.synthetic.eval_examples} eval)"
        if d.train is None:
            raise RecipeError(f"{source}: data.train is required (preference pairs, .jsonl)")
        try:
            tokenizer = load_tokenizer(d.tokenizer)
        except (OSError, ValueError) as e:
            raise RecipeError(f"{source}: data.tokenizer: {e}") from None
        counts = []
        for key in ("train", "eval"):
            path = getattr(d, key)
            if path is None:
                continue
            try:
                rows, dropped = load_pairs(path, tokenizer, d.seq_length, self.config.template, d.skip_bad)
            except (OSError, ValueError) as e:
                raise RecipeError(f"{source}: data.{key}: {e}") from None
            if int(rows.input_ids.max()) >= vocab_size:
                raise RecipeError(f"{source}: data.{key}: token id {int(rows.input_ids.max())} is past the model's "
                                  f"vocab_size {vocab_size}")
            counts.append(f"{key} {len(rows):,} pairs" + (f" ({dropped} left out)" if dropped else ""))
        return ", ".join(counts) + f" of 2 × {d.seq_length} tokens"


def _digest(model: QwenForCausalLM, data: TokenDataset) -> str:
    """What reference log-probs depend on: every weight (a strided sample of its values, its
    name, shape and dtype) and the token rows."""
    h = hashlib.sha256()
    for p in sorted(model.get_parameters(), key=lambda q: q.name):
        h.update(f"{p.name}{p.shape}{p.dtype}".encode())
        h.update(np.ascontiguousarray(p.asnumpy().reshape(-1)[::997]).tobytes())
    h.update(np.ascontiguousarray(data.input_ids).tobytes())
    h.update(np.ascontiguousarray(data.labels).tobytes())
    return h.hexdigest()[:16]
