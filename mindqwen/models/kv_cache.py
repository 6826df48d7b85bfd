"""The static-shape KV cache: its layout, and the step Cell that prefill and decode compile from.

The cache is two tensors, keys and values, each (L, B, KV, MAX, D): layer, batch row, KV head,
cache slot, head dim. It is an *input and output* of the step graph, not a Parameter inside it,
so the same graph runs eagerly, exports to MindIR and converts with ``converter_lite`` without
hidden state; on CPU and Ascend the tensors stay on the device between steps.

Prompts prefilled together are left-padded to one length S and fill slots 0..S-1; after that
each row writes at its own pointer, ``cache_position`` (B, T) (a row that joined a running batch
later is at a lower slot). ``attention_mask`` (B, MAX) marks which slots hold real tokens;
``position_ids`` count real tokens only, so a padded row equals its unpadded self.

    prefill  input_ids (B, S)  position_ids (B, S)  cache_position = 0..S-1 per row  cache = zeros
    decode   input_ids (B, 1)  position_ids (B, 1)  cache_position = each row's next slot  cache = last output
    both  →  logits (B, V) fp32 at the last position, k_cache, v_cache
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Tuple, runtime_checkable

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindqwen.config import QwenConfig



@runtime_checkable
class CachedLM(Protocol):
    """What generation needs of a text model (``QwenForCausalLM``): its config, the KV-cache step
    and the dtype its cache is kept in."""

    config: QwenConfig

    @property
    def cache_dtype(self): ...

    def cached(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache): ...


@runtime_checkable
class ImageConditionedLM(CachedLM, Protocol):
    """A ``CachedLM`` whose prompts may carry an image (``MultimodalQwen``): its vision shape, the
    image token, and the image's cross-attention keys and values, computed once in prefill.
    Its ``cached`` also takes those keys and values and the vision mask."""

    vision_config: object  # multimodal.vision.VisionConfig
    image_token_id: int

    def cross_kv(self, pixel_values): ...

    def cross_kv_shape(self, batch: int) -> list: ...


INPUT_NAMES = ("input_ids", "position_ids", "attention_mask", "cache_position", "k_cache", "v_cache")
OUTPUT_NAMES = ("logits", "k_cache", "v_cache")


@dataclass(frozen=True)
class CacheLayout:
    """Shapes of one cache: ``num_layers, batch_size, num_kv_heads, max_len, head_dim``."""

    num_layers: int
    batch_size: int
    num_kv_heads: int
    max_len: int
    head_dim: int

    @classmethod
    def of(cls, config: QwenConfig, batch_size: int, max_len: int) -> "CacheLayout":
        """The cache of ``config``'s attention layers (a hybrid model's linear-attention layers keep
        ``linear_states`` instead)."""
        layers = sum(kind != "linear_attention" for kind in config.layer_types)
        return cls(layers, batch_size, config.num_key_value_heads, max_len, config.head_dim)

    @property
    def shape(self) -> tuple:
        return (self.num_layers, self.batch_size, self.num_kv_heads, self.max_len, self.head_dim)

    def zeros(self, dtype=ms.float32) -> Tensor:
        return ops.zeros(self.shape, dtype)

    def nbytes(self, dtype=ms.float32) -> int:
        """Bytes of keys plus values."""
        return 2 * int(np.prod(self.shape)) * dtype.itemsize


STATE_NAMES = ("conv_state", "recurrent_state")  # a hybrid model's linear-attention states, after the cache


def linear_state_shapes(config: QwenConfig, batch_size: int) -> Tuple[tuple, ...]:
    """Shapes of a hybrid model's linear-attention states (``STATE_NAMES``), rows on axis 1: the
    convolution's last inputs (L, B, conv_dim, K−1) and the delta rule's state (L, B, Hv, dk, dv), L
    the linear-attention layers; their size does not depend on the sequence length. () for other models."""
    layers = sum(kind == "linear_attention" for kind in config.layer_types)
    if not layers:
        return ()
    conv_dim = config.linear_attention_shapes()["conv1d.weight"][0]
    return ((layers, batch_size, conv_dim, config.linear_conv_kernel_dim - 1),
            (layers, batch_size, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim))


def linear_states(config: QwenConfig, batch_size: int) -> Tuple[Tensor, ...]:
    """The empty (zero, fp32) linear-attention states of ``linear_state_shapes``; () for other models."""
    return tuple(ops.zeros(shape, ms.float32) for shape in linear_state_shapes(config, batch_size))


class CachedStep(nn.Cell):
    """``model.cached`` as a Cell: the graph that prefill (T = S) and decode (T = 1) compile from.

    Args:
        model: a ``QwenForCausalLM`` (LoRA layers may be merged or not).
    """

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)  # keep the model's parameter names in exports
        self.model = model

    def construct(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache, *states):
        return self.model.cached(input_ids, position_ids, attention_mask, cache_position,
                                 k_cache, v_cache, *states)


class ImageCachedStep(nn.Cell):
    """``CachedStep`` of a multimodal model (``MultimodalQwen.cached``): the cross-attention
    blocks' image keys and values (C, B, heads, Nv, D) and ``vision_mask`` (B, T, 1) float32
    follow the six cache inputs; the outputs are the same three."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache,
                  cross_k, cross_v, vision_mask):
        return self.model.cached(input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache,
                                 cross_k, cross_v, vision_mask)


class ImageKeysValues(nn.Cell):
    """pixel_values → the cross-attention keys and values (``MultimodalQwen.cross_kv``): the
    graph a multimodal prefill runs first, once per image."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, pixel_values):
        return self.model.cross_kv(pixel_values)


