"""Recipe tasks: one class per kind of recipe, chosen once from the recipe.

A task is everything ``mindqwen`` does with a recipe of its kind: ``validate`` checks all that its
``train`` and ``export`` will check, ``train`` runs every stage through ``fit`` and writes
``summary.json``, ``trained_model`` loads what a finished run left in its output folder, ``export``
writes the deployable graphs. The command line (``train``, ``validate``, ``export``, ``generate``,
``serve``) asks :func:`task_for` once and calls the task; nothing else branches on the kind.

The kind follows the recipe's own section: a recipe with a ``multimodal`` section is a multimodal
task, one with ``preference`` a preference task, one with neither a causal LM. A new kind is a
module here with its class, a section in ``mindqwen.train.recipe.Recipe`` and a line in ``TASKS``.
"""
from __future__ import annotations

import importlib
import os
from typing import Dict, Optional, Protocol, Sequence, Tuple

from mindspore import nn

from mindqwen.train.recipe import Recipe, RecipeError, load_recipe

# kind → (module, class, the recipe section that selects it; None: recipes without another's section)
TASKS: Dict[str, Tuple[str, str, Optional[str]]] = {
    "causal_lm": ("mindqwen.tasks.causal_lm", "CausalLMTask", None),
    "multimodal": ("mindqwen.tasks.multimodal", "MultimodalTask", "multimodal"),
    "preference": ("mindqwen.tasks.preference", "PreferenceTask", "preference"),
}


class Task(Protocol):
    """What the command line needs of a recipe kind (``recipe`` is the recipe it was made with)."""

    recipe: Recipe

    def validate(self, source: str, tiny: bool = False) -> str:
        """Check everything ``train`` and ``export`` would otherwise fail on later; returns a short
        report. ``tiny`` builds a tiny model of the same architecture and reads no data.

        Raises:
            RecipeError: one line, naming ``source`` and the key.
        """

    def train(self, recipe_text: Optional[str] = None) -> dict:
        """Run every stage, write ``summary.json`` into ``trainer.output_dir``; returns it."""

    def trained_model(self) -> nn.Cell:
        """The model a finished run of the recipe left in its output folder."""

    def export(self, model: nn.Cell, folder: str) -> dict:
        """Export ``model`` with the recipe's ``export`` section into ``folder``; returns the parity figures."""

    def tokenizer_file(self) -> Optional[str]:
        """The tokenizer the recipe trains with (a demo's is written by its run), if any."""


def run_eval(recipe: Recipe, model: nn.Cell, tokenizer_file: Optional[str]) -> dict:
    """The recipe's ``eval`` section on the trained ``model`` (lm-evaluation-harness): the scores
    that summary.json keeps under ``eval``."""
    from mindqwen.harness import evaluate_section
    from mindqwen.train.validate import eval_tokenizer
    print(f"benchmarks: {', '.join(recipe.eval.tasks)}")
    return evaluate_section(recipe.eval, model, eval_tokenizer(recipe, tokenizer_file))


def finish_run(task: Task, model: nn.Cell, summary: dict) -> dict:
    """The end of a task's ``train``: the recipe's benchmarks (``eval``), its export, and
    ``summary.json`` in ``trainer.output_dir``; returns the summary."""
    from mindqwen.io.jsonfile import write_json
    recipe, out = task.recipe, task.recipe.trainer.output_dir
    if recipe.eval is not None:
        summary["eval"] = run_eval(recipe, model, task.tokenizer_file())
    if recipe.export.enabled:
        summary["export"] = task.export(model, os.path.join(out, "export"))
    write_json(os.path.join(out, "summary.json"), summary)
    return summary


def task_for(recipe: Recipe, source: str = "recipe") -> Task:
    """The task of ``recipe``'s kind.

    Raises:
        RecipeError: the recipe has the sections of two kinds.
    """
    chosen = [kind for kind, (_, _, section) in TASKS.items() if section and getattr(recipe, section) is not None]
    if len(chosen) > 1:
        raise RecipeError(f"{source}: a recipe is one task; it has the sections of {' and '.join(chosen)}")
    module, name, _ = TASKS[chosen[0] if chosen else "causal_lm"]
    return getattr(importlib.import_module(module), name)(recipe)


def train_recipe(recipe: Recipe, recipe_text: Optional[str] = None, source: str = "recipe") -> dict:
    """``mindqwen train``: check ``recipe`` as ``mindqwen validate`` does, then run it; returns
    (and writes as ``summary.json``) its figures and output paths. ``source`` names it in errors."""
    task = task_for(recipe, source)
    task.validate(source)
    if recipe.trainer.compile_cache:  # MindSpore cannot cache fused graphs (train/compile_cache.py)
        from mindqwen import backend
        backend.disable_cpu_fusion()
    return task.train(recipe_text)


def validate_recipe(path: str, overrides: Sequence[str] = (), tiny: bool = False) -> str:
    """``mindqwen validate``: load ``path`` with ``overrides`` and check it; returns the report."""
    return task_for(load_recipe(path, overrides), path).validate(path, tiny)


def export_recipe(recipe: Recipe, folder: Optional[str] = None) -> dict:
    """``mindqwen export``: export what a finished run of ``recipe`` trained, with its ``export``
    section, into ``folder`` (default ``<output_dir>/export``)."""
    task = task_for(recipe)
    return task.export(task.trained_model(), folder or os.path.join(recipe.trainer.output_dir, "export"))
