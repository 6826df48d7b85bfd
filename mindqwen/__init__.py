"""mindqwen: MindSpore-native training and deployment of Qwen2 / Qwen2.5 / Qwen3 models."""
from mindqwen.config import ConfigError, QwenConfig
from mindqwen.io.hf import from_pretrained
from mindqwen.io.safetensors import CheckpointError
from mindqwen.models.qwen import QwenForCausalLM, QwenModel

__version__ = "0.1.0"
__all__ = ["CheckpointError", "ConfigError", "QwenConfig", "QwenForCausalLM", "QwenModel",
           "from_pretrained"]
