"""The model a recipe's ``model`` section describes: its config, and the model built from it."""
from __future__ import annotations

from typing import Optional

import mindspore as ms

from mindqwen.config import QwenConfig
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.train.recipe import ModelSection


def model_config(section: ModelSection, vocab_size: Optional[int] = None) -> QwenConfig:
    """The checkpoint's config, else the preset's / explicit one (``section.config`` overrides either).

    Args:
        vocab_size: the tokenizer's vocabulary, used when neither the checkpoint nor the
            section fixes it (the demos train their own tokenizers).
    """
    if section.checkpoint:
        return QwenConfig.from_hf(section.checkpoint).replace(**section.config)
    overrides = dict(section.config)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    return QwenConfig.from_preset(section.preset, **overrides) if section.preset else QwenConfig(**overrides)


def build_model(section: ModelSection, vocab_size: Optional[int] = None) -> QwenForCausalLM:
    """From an HF checkpoint, or random weights of ``model_config(section, vocab_size)``; with
    ``section.adapter`` merged in."""
    if section.checkpoint:
        model = QwenForCausalLM.from_pretrained(section.checkpoint, section.dtype, **section.config)
    else:
        model = QwenForCausalLM(model_config(section, vocab_size), getattr(ms, section.dtype))
    if section.adapter:
        from mindqwen.lora import load_adapter, merge_and_unload
        model = merge_and_unload(load_adapter(model, section.adapter))
    if section.compile_once is not None:
        model.model.set_compile_once(section.compile_once)
    return model
