"""mindqwen: MindSpore-native training and deployment of Qwen2 / Qwen2.5 / Qwen3 models.

The public names load on first use (PEP 562), so ``import mindqwen.data…`` in a preprocessing
worker does not pay for importing MindSpore. Importing mindqwen before MindSpore lets it set
what MindSpore reads only when it loads (``mindqwen.backend``).
"""
import importlib

from mindqwen import backend

backend.prepare_process()

__version__ = "0.1.0"

_EXPORTS = {
    "mindqwen.config": ["ConfigError", "QwenConfig"],
    "mindqwen.io.hf": ["from_pretrained"],
    "mindqwen.io.safetensors": ["CheckpointError"],
    "mindqwen.lora": ["LoraConfig", "LoRALayer", "apply_lora", "load_adapter", "mark_only_lora_trainable",
                      "merge_and_unload", "merge_lora", "save_adapter", "trainable_report", "unmerge_lora"],
    "mindqwen.models.qwen": ["QwenForCausalLM", "QwenModel"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'mindqwen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
