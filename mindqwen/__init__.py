"""mindqwen: MindSpore-native training and deployment of Qwen2 / Qwen2.5 / Qwen3 models."""
from mindqwen.config import ConfigError, QwenConfig
from mindqwen.io.hf import from_pretrained
from mindqwen.io.safetensors import CheckpointError
from mindqwen.lora import (LoraConfig, LoRALayer, apply_lora, load_adapter, mark_only_lora_trainable,
                           merge_and_unload, merge_lora, save_adapter, trainable_report, unmerge_lora)
from mindqwen.models.qwen import QwenForCausalLM, QwenModel

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "LoRALayer", "LoraConfig", "QwenConfig", "QwenForCausalLM",
           "QwenModel", "apply_lora", "from_pretrained", "load_adapter", "mark_only_lora_trainable",
           "merge_and_unload", "merge_lora", "save_adapter", "trainable_report", "unmerge_lora"]
