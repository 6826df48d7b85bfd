"""mindqwen: MindSpore-native training and deployment of Qwen2 / Qwen2.5 / Qwen3 models.

The public names load on first use (PEP 562), so ``import mindqwen.data…`` in a preprocessing
worker does not pay for importing MindSpore. Importing mindqwen before MindSpore lets it set
what MindSpore reads only when it loads (``mindqwen.backend``).
"""
import importlib
from typing import TYPE_CHECKING

from mindqwen import backend

backend.prepare_process()

__version__ = "0.2.0"

_EXPORTS = {
    "mindqwen.config": ["ConfigError", "ExecutionOptions", "QwenConfig"],
    "mindqwen.data.tokenizer": ["load_tokenizer"],
    "mindqwen.data.loader": ["TokenDataset"],
    "mindqwen.generation": ["GenerationConfig", "Generator", "OutputFilter", "generate"],
    "mindqwen.io.safetensors": ["CheckpointError"],
    "mindqwen.lora": ["LoraConfig", "LoRALayer", "apply_lora", "load_adapter", "mark_only_lora_trainable",
                      "merge_and_unload", "merge_lora", "save_adapter", "trainable_report", "unmerge_lora"],
    "mindqwen.models.graph": ["configure"],
    "mindqwen.models.qwen": ["QwenForCausalLM", "QwenModel", "from_pretrained"],
    "mindqwen.train.config": ["TrainerConfig"],
    "mindqwen.train.loop": ["TrainingDiverged", "fit"],
    "mindqwen.train.precision": ["PrecisionConfig"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from mindqwen.config import ConfigError, ExecutionOptions, QwenConfig  # noqa: F401
    from mindqwen.data.tokenizer import load_tokenizer  # noqa: F401
    from mindqwen.data.loader import TokenDataset  # noqa: F401
    from mindqwen.generation import GenerationConfig, Generator, OutputFilter, generate  # noqa: F401
    from mindqwen.io.safetensors import CheckpointError  # noqa: F401
    from mindqwen.lora import (LoraConfig, LoRALayer, apply_lora, load_adapter, mark_only_lora_trainable,  # noqa: F401
                               merge_and_unload, merge_lora, save_adapter, trainable_report, unmerge_lora)
    from mindqwen.models.graph import configure  # noqa: F401
    from mindqwen.models.qwen import QwenForCausalLM, QwenModel, from_pretrained  # noqa: F401
    from mindqwen.train.config import TrainerConfig  # noqa: F401
    from mindqwen.train.loop import TrainingDiverged, fit  # noqa: F401
    from mindqwen.train.precision import PrecisionConfig  # noqa: F401


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'mindqwen' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
