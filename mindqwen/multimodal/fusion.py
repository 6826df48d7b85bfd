"""A Qwen language model fused with a vision encoder through gated cross-attention, and the one
place that decides what trains: ``MultimodalLoraConfig``.

    pixels ─► vision (ViT) ─► projector ─► vision tokens (B, Nv, H) ──────────────┐
    input_ids ─► embed ─► layer 0 … layer i ─► cross_attn[i] ─► … ─► norm ─► logits
                                               (only after the layers in ``cross_layers``)

The language model is held as it is: its parameters keep their names (``model.layers.0…``,
``lm_head.weight``), so its checkpoint loads and saves unchanged. The new blocks live beside the
decoder layers under ``vision.``, ``projector.`` and ``cross_attn.<k>.``. With every gate at zero
(the initial state) the fused model computes exactly the text model's logits.

Groups and policies: ``vision``, ``projector``, ``text``, ``cross_attention``, each ``frozen``
(no gradient), ``lora`` (LoRA A/B of its targeted projections train; for cross-attention the
gates too, or no signal could pass) or ``full`` (every parameter of the group trains).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindqwen.lora import LoraConfig, inject_lora
from mindqwen.models.graph import invalidate_compiled_graphs
from mindqwen.models.layers import Linear
from mindqwen.models.qwen import QwenForCausalLM
from mindqwen.multimodal.cross_attention import GatedCrossAttention
from mindqwen.multimodal.vision import Projector, VisionConfig, VisionEncoder

GROUPS = ("vision", "projector", "text", "cross_attention")
MODES = ("frozen", "lora", "full")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class GroupPolicy:
    """How one group trains: ``mode`` frozen | lora | full; LoRA ``r``, ``lora_alpha`` and targets."""

    mode: str = "frozen"
    r: int = 8
    lora_alpha: float = 16.0
    target_modules: List[str] = field(default_factory=lambda: list(ATTENTION))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"policy mode must be one of {MODES}, got {self.mode!r}")


@dataclass
class MultimodalLoraConfig:
    """Per group policy, in one place. Defaults: vision LoRA r 8 on attention, projector
    trained fully, text LoRA r 8 on q/v, cross-attention LoRA r 4 on q/k/v/o (+ gates).

    Attributes:
        temporal_r: video only: LoRA rank of the temporal attention projections; the spatial
            ones use ``vision.r`` (defaults 4 and 8).
    """

    vision: GroupPolicy = field(default_factory=lambda: GroupPolicy("lora", 8, 16.0, [f"attn.{p}" for p in ATTENTION]))
    projector: GroupPolicy = field(default_factory=lambda: GroupPolicy("full", target_modules=["linear_1", "linear_2"]))
    text: GroupPolicy = field(default_factory=lambda: GroupPolicy("lora", 8, 16.0, ["q_proj", "v_proj"]))
    cross_attention: GroupPolicy = field(default_factory=lambda: GroupPolicy("lora", 4, 8.0, list(ATTENTION)))
    temporal_r: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.temporal_r, int) or self.temporal_r < 1:
            raise ValueError(f"temporal_r must be a positive integer, got {self.temporal_r!r}")


class MultimodalQwen(nn.Cell):
    """A ``QwenForCausalLM`` with a vision encoder, a projector and gated cross-attention blocks.

    Args:
        lm: the language model (used as is, keys unchanged).
        vision_config: the encoder's shape (``num_frames`` > 1: video).
        cross_layers: decoder layer indices followed by a cross-attention block.
        image_token_id: the placeholder id; text from it on sees the image (None: all text does).
    """

    def __init__(self, lm: QwenForCausalLM, vision_config: VisionConfig, cross_layers: Sequence[int],
                 image_token_id: Optional[int] = None):
        super().__init__(auto_prefix=False)  # the LM's parameter names stay as they are
        c = lm.config
        bad = [i for i in cross_layers if not 0 <= i < c.num_hidden_layers]
        if bad or not cross_layers or len(set(cross_layers)) != len(cross_layers):
            raise ValueError(f"cross_layers must be distinct decoder layer indices in 0..{c.num_hidden_layers - 1}, "
                             f"got {list(cross_layers)}")
        self.lm, self.config, self.vision_config = lm, c, vision_config
        self.vision = VisionEncoder(vision_config)
        self.projector = Projector(vision_config.hidden_size, c.hidden_size)
        self.cross_attn = nn.CellList([GatedCrossAttention(c.hidden_size, c.num_attention_heads, c.rms_norm_eps)
                                       for _ in cross_layers])
        for name in ("vision", "projector", "cross_attn"):
            getattr(self, name).update_parameters_name(name + ".")
            _fan_in_init(getattr(self, name))
        order = sorted(cross_layers)
        self.cross_after = tuple(order.index(i) if i in order else -1 for i in range(c.num_hidden_layers))
        self.cross_layers = order
        self.image_token_id = image_token_id

    def construct(self, input_ids, pixel_values, attention_mask=None, labels=None):
        """input_ids (B, S); pixel_values (B, 3, H, W) or (B, T, 3, H, W) → logits (B, S, V) or the loss."""
        vision = self.projector(self.vision(pixel_values))  # (B, Nv, H)
        if self.image_token_id is None:
            vision_mask = ops.ones(input_ids.shape + (1,), ms.float32)
        else:
            seen = ops.cumsum((input_ids == self.image_token_id).astype(ms.int32), 1)
            vision_mask = (seen > 0).astype(ms.float32).expand_dims(-1)  # (B, S, 1)
        x, cos, sin, masked, window_masked = self.lm.model.prepare(input_ids, attention_mask)
        for i, layer in enumerate(self.lm.model.layers):
            x = layer(x, cos, sin, window_masked if layer.sliding else masked)
            if self.cross_after[i] >= 0:
                x = self.cross_attn[self.cross_after[i]](x, vision, vision_mask)
        h = self.lm.model.norm(x)
        if labels is None:
            return self.lm.logits(h)
        return self.lm.loss(h, labels)

    @property
    def cache_dtype(self):
        """The dtype the KV cache is kept in: the LM's."""
        return self.lm.cache_dtype

    def cross_kv_shape(self, batch: int) -> List[int]:
        """The shape of ``cross_kv``'s keys (and values) for ``batch`` images (-1: dynamic)."""
        block, v = self.cross_attn[0], self.vision_config
        return [len(self.cross_attn), batch, block.heads, v.num_frames * v.num_patches, block.head_dim]

    def cross_kv(self, pixel_values):
        """pixel_values (B, 3, H, W) or (B, T, 3, H, W) → every cross-attention block's image keys
        and values, stacked (C, B, heads, Nv, D): computed once per image when generating."""
        vision = self.projector(self.vision(pixel_values))
        keys, values = (), ()
        for block in self.cross_attn:
            k, v = block.keys_values(vision)
            keys, values = keys + (k,), values + (v,)
        return ops.stack(keys), ops.stack(values)

    def cached(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache,
               cross_k, cross_v, vision_mask):
        """The LM's KV-cache step (``QwenForCausalLM.cached``, same inputs and outputs) with each
        cross-attention block reading its cached image keys/values (``cross_kv``);
        vision_mask (B, T, 1): 1 where a token sees the image (from the image token on)."""
        lm = self.lm.model
        x, cos, sin, masked, window_masked = lm.prepare_cached(input_ids, position_ids, attention_mask,
                                                               cache_position, k_cache.shape[3])
        k_layers, v_layers = ops.unstack(k_cache, 0), ops.unstack(v_cache, 0)
        image_keys, image_values = ops.unstack(cross_k, 0), ops.unstack(cross_v, 0)
        keys, values = (), ()
        for i, layer in enumerate(lm.layers):
            x, k, v = layer.cached(x, cos, sin, window_masked if layer.sliding else masked,
                                   k_layers[i], v_layers[i], cache_position)
            keys, values = keys + (k,), values + (v,)
            if self.cross_after[i] >= 0:
                j = self.cross_after[i]
                x = self.cross_attn[j].attend(x, image_keys[j], image_values[j], vision_mask)
        return self.lm.last_logits(lm.norm(x)), ops.stack(keys), ops.stack(values)

    def groups(self) -> Dict[str, nn.Cell]:
        return {"vision": self.vision, "projector": self.projector, "text": self.lm,
                "cross_attention": self.cross_attn}


def _fan_in_init(cell: nn.Cell) -> None:
    """New (not loaded) linear layers: torch's default U(±1/√fan_in) instead of the LM's N(0, 0.02).

    With 0.02 at small widths the chain vision → projector → v_proj → o_proj shrinks the signal
    ~10⁴×, and behind a zero gate nothing learns; fan-in scaling keeps every stage at unit size.
    """
    rng = np.random.default_rng(0)
    for _, layer in cell.cells_and_names():
        if isinstance(layer, Linear):
            bound = 1.0 / np.sqrt(layer.in_features)
            for p in (layer.weight, layer.bias):
                if p is not None:
                    p.set_data(Tensor(rng.uniform(-bound, bound, p.shape).astype(np.float32)).astype(p.dtype))


def group_of(name: str) -> str:
    """The group a parameter name belongs to."""
    for prefix, group in (("vision.", "vision"), ("projector.", "projector"), ("cross_attn.", "cross_attention")):
        if name.startswith(prefix):
            return group
    return "text"


def apply_multimodal_lora(model: MultimodalQwen, config: Optional[MultimodalLoraConfig] = None) -> MultimodalQwen:
    """Inject LoRA into the ``lora`` groups and set every parameter's trainability from ``config``."""
    config = config or MultimodalLoraConfig()
    prefixes = {"vision": "vision.", "projector": "projector.", "text": "", "cross_attention": "cross_attn."}
    for group, cell in model.groups().items():
        policy: GroupPolicy = getattr(config, group)
        if policy.mode != "lora":
            continue
        try:
            if group == "vision" and model.vision_config.num_frames > 1:  # spatial and temporal ranks differ
                temporal = LoraConfig(r=config.temporal_r, lora_alpha=policy.lora_alpha * config.temporal_r / policy.r,
                                      target_modules=[f"temporal_attn.{p}" for p in ATTENTION])
                inject_lora(cell, temporal, prefixes[group])
            inject_lora(cell, LoraConfig(r=policy.r, lora_alpha=policy.lora_alpha,
                                         target_modules=policy.target_modules), prefixes[group])
        except ValueError as e:
            raise ValueError(f"{group}: {e}") from None
    for p in model.get_parameters():
        mode = getattr(config, group_of(p.name)).mode
        is_adapter = p.name.endswith((".lora_a", ".lora_b")) or (group_of(p.name) == "cross_attention"
                                                                  and p.name.endswith(".gate"))
        p.requires_grad = mode == "full" or (mode == "lora" and is_adapter)
    model.multimodal_lora_config = config
    invalidate_compiled_graphs(model)
    return model


def trainable_by_group(model: MultimodalQwen) -> Dict[str, int]:
    """Trainable parameter count per group."""
    counts = {g: 0 for g in GROUPS}
    for p in model.trainable_params():
        counts[group_of(p.name)] += int(p.size)
    return counts
