"""Recipes: one YAML file composing model + data + LoRA + trainer + parallel + export.

The YAML mirrors the typed dataclasses below. Loading is strict: an unknown key is an error
naming the file, line, key path and the closest valid key; a wrong type names the key, the
expected and the given type. ``key.path=value`` overrides (from the command line) are parsed as
YAML scalars or flow lists (``lora.target_modules=[q_proj,v_proj]``) and checked the same way.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import importlib.resources
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from mindqwen.config import QwenConfig
from mindqwen.data.chat import TEMPLATES
from mindqwen.generation import GenerationConfig, OutputFilter
from mindqwen.lora import LoraConfig
from mindqwen.multimodal.fusion import MultimodalLoraConfig
from mindqwen.multimodal.vision import VisionConfig
from mindqwen.preference import PreferenceConfig
from mindqwen.train.config import TrainerConfig
from mindqwen.train.distributed import ParallelConfig
from mindqwen.train.optim import SCHEDULES


MODEL_DTYPES = ("float32", "float16", "bfloat16")
# keys recipes used to have: the error says why they went
REMOVED_KEYS = {
    "serve.batch_timeout_ms": "serving uses continuous batching (requests join the running batch between "
                              "decode steps, no window to wait for): delete the key",
}


class RecipeError(ValueError):
    """A recipe that does not load or validate; the message names the file and key."""


@dataclass
class ModelSection:
    """Attributes:
        checkpoint: HF folder to start from (config.json + safetensors); None builds from
            ``preset`` / ``config`` with random weights.
        preset: a published shape (``mindqwen.presets.PRESETS``), used without a checkpoint.
        config: QwenConfig field overrides (e.g. a tiny ``num_hidden_layers`` for a test, or a
            checkpoint's ``moe_capacity_factor``).
        dtype: parameter dtype: float32 | float16 | bfloat16 (Ascend only).
        compile_once: compile equal decoder layers once instead of once per layer
            (``QwenModel.set_compile_once``): null (auto) for LoRA's training layers, true for
            every layer and the KV-cache step too (the first token sooner, decoding slower),
            false for none.
        adapter: a PEFT adapter folder merged into the checkpoint's weights when it loads (the
            LoRA of an earlier stage, e.g. SFT before preference tuning).
    """

    checkpoint: Optional[str] = None
    preset: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict, metadata={"schema": QwenConfig})
    dtype: str = "float32"
    compile_once: Optional[bool] = None
    adapter: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"model.dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")


@dataclass
class SyntheticSection:
    """The demo's self-made data (``mindqwen.demos.letters``), written to ``<output_dir>/data``
    with a SentencePiece tokenizer trained on it.

    Attributes:
        seed: data seed.
        pretrain_examples, train_examples, eval_examples: sizes of the three splits.
        alphabet: how many letters (from a) the task uses.
        vocab_size: tokenizer vocabulary (the model's ``vocab_size`` follows it).
        word_lengths: [min, max] letters per question (the bare form keeps 3-5).
    """

    seed: int = 0
    pretrain_examples: int = 6000
    train_examples: int = 1200
    eval_examples: int = 120
    alphabet: int = 26
    vocab_size: int = 150
    word_lengths: List[int] = field(default_factory=lambda: [3, 5])

    def __post_init__(self) -> None:
        if len(self.word_lengths) != 2 or not 1 <= self.word_lengths[0] <= self.word_lengths[1]:
            raise ValueError(f"data.synthetic.word_lengths must be [min, max] with 1 <= min <= max, "
                             f"got {self.word_lengths}")


@dataclass
class DataSection:
    """Attributes:
        train: training data: a ``.npy`` int array [examples, seq_length] of token ids, or a
            ``.jsonl`` file of ``{"prompt", "response"}`` records (loss on the response only).
        eval: validation data, same formats; ``.jsonl`` also gives exact-match accuracy.
        pretrain: data for the ``pretrain`` stage: plain text (``.txt``, one document per line,
            packed) or ``.jsonl`` prompt/response pairs (loss on the responses).
        tokenizer: SentencePiece ``.model`` (needed for ``.jsonl`` and ``.txt`` data).
        seq_length: tokens per example.
        reset_positions: packed rows hold several samples: each restarts its positions at 0 and
            attends only to itself, by the boundaries the packer recorded (a ``mindqwen
            preprocess`` folder, ``.txt`` text); ``.jsonl`` rows hold one example each and need
            none; ``.npy`` token rows record none and are refused.
        synthetic: make the demo data instead of reading files.
        workers: multimodal: threads transforming images (resize, crop, normalise).
        read_workers: multimodal: readers of the image (video) files: 1 thread, or processes.
        skip_bad: multimodal: leave out (and count) records whose JSON, image or video is bad
            instead of stopping at the first (``file:line: what``).
    """

    train: Optional[str] = None
    eval: Optional[str] = None
    pretrain: Optional[str] = None
    tokenizer: Optional[str] = None
    seq_length: int = 256
    reset_positions: bool = False
    synthetic: Optional[SyntheticSection] = None
    workers: int = 2
    read_workers: int = 1
    skip_bad: bool = False

    def __post_init__(self) -> None:
        if self.seq_length < 2:
            raise ValueError(f"data.seq_length must be >= 2, got {self.seq_length}")
        if self.workers < 1 or self.read_workers < 1:
            raise ValueError(f"data.workers and data.read_workers must be >= 1, got {self.workers} and "
                             f"{self.read_workers}")


@dataclass
class PretrainSection:
    """A full-parameter training stage run before the main one (the demo pre-trains its model
    from scratch). Unlisted trainer settings (precision, seed, mode, …) come from ``trainer``.

    Attributes:
        max_steps, micro_batch_size, lr, warmup_steps, schedule: as in ``trainer``.
    """

    max_steps: int = 1000
    micro_batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    schedule: str = "cosine"

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.micro_batch_size < 1 or self.lr <= 0:
            raise ValueError("pretrain: max_steps and micro_batch_size must be >= 1 and lr > 0")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"pretrain.warmup_steps={self.warmup_steps} must be in [0, max_steps={self.max_steps}]")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pretrain.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")


@dataclass
class ExportSection:
    """Attributes:
        enabled: export the prefill + decode MindIR graphs after training.
        batch_sizes: batch sizes the device graphs are built for (converter gears).
        max_seq_len: KV-cache length: prompt plus generated tokens.
        seq_buckets: prompt-length gears of the prefill graph (None: 64, 128, … max_seq_len).
        dtype: weights of the exported graphs, float32 | float16 (softmax/norms stay fp32).
        soc_version: MindSpore Lite target (Ascend310 | Ascend310P | Ascend910 | Ascend910B).
        precision_mode: converter precision mode, ``ge.exec.precision_mode`` spelling
            (force_fp32 | force_fp16 | must_keep_origin_dtype | allow_mix_precision |
            allow_fp32_to_fp16); None picks must_keep_origin_dtype for fp16, force_fp32 for fp32.
    """

    enabled: bool = False
    batch_sizes: List[int] = field(default_factory=lambda: [1])
    max_seq_len: int = 2048
    seq_buckets: Optional[List[int]] = None
    dtype: str = "float16"
    soc_version: str = "Ascend310"
    precision_mode: Optional[str] = None

    def __post_init__(self) -> None:
        from mindqwen.export.lite import check_target
        if self.dtype not in ("float32", "float16"):
            raise ValueError(f"export.dtype must be float32 or float16, got {self.dtype!r}")
        check_target(self.soc_version, self.precision_mode)


@dataclass
class OutputFilterSection:
    """Attributes:
        block: strings to block in generated text; ``re:<pattern>`` is a regular expression.
        action: mask (``*`` per character) | drop (remove) | stop (end the answer before it).
    """

    block: List[str] = field(default_factory=list)
    action: str = "mask"

    def __post_init__(self) -> None:
        OutputFilter(self.block, self.action)  # raises on a bad action or pattern


@dataclass
class GenerationSection(GenerationConfig):
    """``GenerationConfig`` (every field, HF ``generate`` semantics) as the defaults for sample
    answers, the export manifest and ``mindqwen serve``, with the output filter.

    Attributes:
        output_filter: block-list applied to generated text while generating and serving.
    """

    output_filter: OutputFilterSection = field(default_factory=OutputFilterSection)

    def config(self, **overrides) -> GenerationConfig:
        """The ``GenerationConfig`` these defaults describe, with ``overrides``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationConfig) if f.init}
        return GenerationConfig(**{**fields, **overrides})


@dataclass
class ServeSection:
    """Attributes:
        host, port: where ``mindqwen serve`` listens.
        max_batch_size: requests decoded together at most.
        max_queue: queued requests beyond which new ones get HTTP 503.
        max_prompt_tokens: longer prompts get HTTP 400.
        max_connections: open connections at most (beyond: HTTP 503).
        max_body_bytes: larger request bodies get HTTP 413.
        keep_alive_s: idle keep-alive connections close after this many seconds.
        log_prompts: write prompt text into the request log (off: sizes and status only).
        allowed_local_media_path: a folder on the server's machine whose image files a
            multimodal model's chat requests may name (``image_url`` a path or ``file://``);
            null: none, data URLs only (always accepted).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch_size: int = 16
    max_queue: int = 64
    max_prompt_tokens: int = 2048
    max_connections: int = 512
    max_body_bytes: int = 1048576
    keep_alive_s: float = 5.0
    log_prompts: bool = False
    allowed_local_media_path: Optional[str] = None

    def __post_init__(self) -> None:
        if min(self.max_batch_size, self.max_queue, self.max_prompt_tokens, self.max_connections,
               self.max_body_bytes) < 1 or self.keep_alive_s <= 0:
            raise ValueError("serve: max_batch_size, max_queue, max_prompt_tokens, max_connections and "
                             "max_body_bytes must be >= 1, keep_alive_s > 0")


@dataclass
class EvalSection:
    """Benchmarks run on the trained model after training, through lm-evaluation-harness
    (``pip install 'mindqwen[eval]'``); the scores go into summary.json.

    Attributes:
        tasks: task or group names (hellaswag, mmlu, ...; ``lm_eval ls tasks`` lists them), or
            names of YAML tasks in ``include_path``.
        num_fewshot: examples before each question (None: each task's own).
        limit: examples per task (a number, or a fraction below 1); None: all.
        batch_size: rows per forward pass.
        include_path: a folder of your own task YAML files.
        apply_chat_template: wrap prompts in the model's chat template.
        fewshot_as_multiturn: few-shot examples as chat turns (with apply_chat_template).
    """

    tasks: List[str] = field(default_factory=list)
    num_fewshot: Optional[int] = None
    limit: Optional[float] = None
    batch_size: int = 8
    include_path: Optional[str] = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("eval.tasks: name at least one task")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"eval.limit must be > 0, got {self.limit:g}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"eval.num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be >= 1, got {self.batch_size}")
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise ValueError("eval.fewshot_as_multiturn needs eval.apply_chat_template: true")


@dataclass
class ShapesSection:
    """The multimodal demo's self-made image-caption data (``mindqwen.demos.shapes``),
    written as PNG files and JSONL to ``<output_dir>/data`` and read back like a user's data.

    Attributes:
        seed: data seed.
        train_images, eval_images: sizes of the two splits (every image is a new draw).
        vocab_size: SentencePiece vocabulary (the LM's ``vocab_size`` is one more: ``<image>``).
    """

    seed: int = 0
    train_images: int = 3000
    eval_images: int = 200
    vocab_size: int = 96

    def __post_init__(self) -> None:
        if self.train_images < 1 or self.eval_images < 1:
            raise ValueError("multimodal.shapes: train_images and eval_images must be >= 1")


@dataclass
class MultimodalSection:
    """A vision encoder fused into the LM by gated cross-attention (``docs/multimodal.md``).

    Attributes:
        vision: the ViT's shape (``num_frames`` > 1: the space-time encoder for video).
        cross_layers: decoder layers followed by a cross-attention block.
        policy: per group (vision, projector, text, cross_attention) frozen | lora | full.
        text_steps: steps of the LM alone on the captions before fusion (0: none).
        vision_steps, vision_lr: steps and peak rate of the ViT's attribute pre-training on the
            shapes demo's colour/shape/place labels (0: none).
        template: chat template of the prompts (qwen2.5 | qwen3).
        shapes: the synthetic demo data; null: ``data.train`` / ``data.eval`` JSONL image-text
            (or video-text) records with ``data.tokenizer`` (``docs/multimodal.md``).
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    cross_layers: List[int] = field(default_factory=lambda: [0])
    policy: MultimodalLoraConfig = field(default_factory=MultimodalLoraConfig)
    text_steps: int = 0
    vision_steps: int = 0
    vision_lr: float = 1e-3
    template: str = "qwen2.5"
    shapes: Optional[ShapesSection] = None

    def __post_init__(self) -> None:
        if self.text_steps < 0 or self.vision_steps < 0 or self.vision_lr <= 0:
            raise ValueError("multimodal: text_steps and vision_steps must be >= 0, vision_lr > 0")
        if self.template not in TEMPLATES:
            raise ValueError(f"multimodal.template must be one of {', '.join(TEMPLATES)}, got {self.template!r}")


@dataclass
class Recipe:
    """A complete training recipe (see ``docs/recipes.md``)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: Optional[LoraConfig] = None
    pretrain: Optional[PretrainSection] = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    export: ExportSection = field(default_factory=ExportSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    serve: ServeSection = field(default_factory=ServeSection)
    multimodal: Optional[MultimodalSection] = None
    preference: Optional[PreferenceConfig] = None
    eval: Optional[EvalSection] = None


# ---------------------------------------------------------------------------- loading
def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Read, override, type-check and build a ``Recipe`` from ``path``.

    Raises:
        RecipeError: naming the file, line and key of the first problem.
    """
    path = find_recipe(path)
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
    loader = _LOADER(text)  # one parse: the node tree (for line numbers), then the data
    try:
        node = loader.get_single_node()
        raw = (loader.construct_document(node) if node is not None else None) or {}
    except (yaml.YAMLError, RecursionError) as e:
        raise RecipeError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    finally:
        loader.dispose()
    lines = _key_lines(node, path) if node is not None else {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    if not raw and not overrides:
        raise RecipeError(f"{path}: the recipe is empty (`mindqwen recipes cp` copies a bundled one to start from)")
    for item in overrides:
        lines.pop(_apply_override(raw, item, path), None)  # errors there point at the override
    return _build(Recipe, raw, path, "", lines)


def _apply_override(raw: dict, item: str, path: str) -> str:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise RecipeError(f"{path}: override {item!r} must look like section.key=value")
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError:
        parsed = value
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise RecipeError(f"{path}: override {key}: {part} is not a section")
    node[parts[-1]] = parsed
    return key


def _key_lines(node, file: str, prefix: str = "") -> Dict[str, int]:
    """key path → 1-based line, from the YAML node tree.

    Raises:
        RecipeError: on a key given twice in one mapping (YAML keeps the last one silently).
    """
    out: Dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = f"{prefix}{k.value}"
            line = k.start_mark.line + 1
            if path in out:
                raise RecipeError(f"{file}:{line}: duplicate key {path} (first given on line {out[path]})")
            out[path] = line
            out.update(_key_lines(v, file, path + "."))
    return out


def _where(path: str, key: str, lines: Dict[str, int]) -> str:
    line = lines.get(key)
    return f"{path}:{line}" if line else f"{path} (override)"


def _build(cls, raw: Any, path: str, prefix: str, lines: Dict[str, int]):
    if not isinstance(raw, dict):
        raise RecipeError(f"{_where(path, prefix.rstrip('.'), lines)}: {prefix.rstrip('.') or 'recipe'} must be "
                          f"a mapping, got {type(raw).__name__}")
    kwargs = _checked_fields(cls, raw, path, prefix, lines)
    for f in dataclasses.fields(cls):  # free-form mappings of another class's fields
        if "schema" in f.metadata and kwargs.get(f.name):
            kwargs[f.name] = _checked_fields(f.metadata["schema"], kwargs[f.name], path, f"{prefix}{f.name}.", lines)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise RecipeError(f"{path}: {prefix.rstrip('.') or 'recipe'}: {e}") from None


def _checked_fields(cls, raw: dict, path: str, prefix: str, lines: Dict[str, int]) -> dict:
    """``raw``'s keys, each a field of ``cls`` and coerced to its type."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in raw.items():
        full = prefix + str(key)
        if full in REMOVED_KEYS:
            raise RecipeError(f"{_where(path, full, lines)}: {full} was removed: {REMOVED_KEYS[full]}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            raise RecipeError(f"{_where(path, full, lines)}: unknown key {full}{hint}")
        kwargs[key] = _coerce(hints[key], value, path, full, lines)
    return kwargs


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it
MAX_INT = 2 ** 31 - 1  # every integer in a recipe is a count, size, index, port or seed



def _coerce(hint, value, path: str, key: str, lines: Dict[str, int]):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _coerce(option, value, path, key, lines)
            except RecipeError as e:
                errors.append(e)
        raise errors[-1] if len(options) == 1 else RecipeError(
            f"{_where(path, key, lines)}: {key} must be {' or '.join(_name(o) for o in options)}, "
            f"got {type(value).__name__} {value!r}")
    if dataclasses.is_dataclass(hint):  # a section: every dataclass field type is one
        return _build(hint, {} if value is None else value, path, key + ".", lines)
    if origin in (list, List, collections.abc.Sequence):
        if not isinstance(value, list):
            raise RecipeError(f"{_where(path, key, lines)}: {key} must be a list, got {type(value).__name__} {value!r}")
        return [_coerce(args[0], v, path, key, lines) for v in value] if args else value
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise RecipeError(f"{_where(path, key, lines)}: {key} must be a mapping, got {type(value).__name__}")
        return value
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 1e300 else value  # else: not a float, reported below
    if hint is float and isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise RecipeError(f"{_where(path, key, lines)}: {key} must be {_name(hint)}, got "
                          f"{type(value).__name__} {value!r}")
    if hint is float and not math.isfinite(value):
        raise RecipeError(f"{_where(path, key, lines)}: {key} must be a finite number, got {value!r}")
    if hint is int and not -MAX_INT <= value <= MAX_INT:
        raise RecipeError(f"{_where(path, key, lines)}: {key}={value} is out of range (|value| <= {MAX_INT:,})")
    return value


def sections(cls: type = Recipe) -> List[type]:
    """``cls`` and every section class reachable from its fields (a field whose type is a
    dataclass is a section), depth first, each once."""
    found = [cls]
    for hint in typing.get_type_hints(cls).values():
        for t in [hint, *typing.get_args(hint)]:
            if dataclasses.is_dataclass(t) and t not in found:
                found += [c for c in sections(t) if c not in found]
    return found


def _name(hint) -> str:
    return getattr(hint, "__name__", str(hint)).replace("typing.", "")


def recipes_folder() -> str:
    """The bundled ``recipes/``: the package data ``mindqwen.recipes`` of an installed wheel,
    else (a checkout, an editable install) the folder next to the package."""
    try:
        installed = importlib.resources.files("mindqwen.recipes")
    except (ModuleNotFoundError, TypeError):
        installed = None
    if isinstance(installed, os.PathLike) and os.path.isdir(installed):
        return os.fspath(installed)
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "recipes")


def find_recipe(name_or_path: str) -> str:
    """A recipe file: ``name_or_path`` itself, or a bundled recipe by name (``qwen2_5/0.5b_lora``)."""
    if os.path.isfile(name_or_path):
        return name_or_path
    name = name_or_path[:-len(".yaml")] if name_or_path.endswith(".yaml") else name_or_path
    bundled = bundled_recipes().get(name.replace(os.sep, "/").removeprefix("recipes/"))
    if bundled is None:
        raise RecipeError(f"{name_or_path}: recipe file not found (and not a bundled recipe: `mindqwen recipes ls`)")
    return bundled


def bundled_recipes() -> Dict[str, str]:
    """name (path under recipes/ without .yaml) → file, sorted."""
    root = recipes_folder()
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".yaml"):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, root)[:-len(".yaml")].replace(os.sep, "/")] = path
    return dict(sorted(found.items()))

