"""Vision encoders: a ViT (images) and a factorized space-time ViT (video), and the projector
to the language model's width. Read top to bottom; ``construct`` methods are tensor math only.

Parameter names follow HF's ViT where a counterpart exists (``VIT_HF_KEYS`` maps them), so a
compatible ViT checkpoint loads by key map (``load_vit_weights``).

    pixels (B, 3, H, W) ─► patches (B, N, 3·p·p) ─► patch_embed ─► + pos_embed ─► L × Block ─► norm
    Block: x + attn(norm1(x)); x + mlp(norm2(x))                           (pre-norm, GELU MLP)
    video (B, T, 3, H, W): Block = x + spatial_attn (within a frame) + temporal_attn (across frames) + mlp
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from mindqwen.models.layers import Linear


@dataclass
class VisionConfig:
    """Shape of the vision encoder (defaults: ViT-B/16 at 224).

    Attributes:
        num_frames: 1 for images; > 1 builds the factorized space-time encoder for video.
    """

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    layer_norm_eps: float = 1e-6
    num_frames: int = 1

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "num_frames", "num_channels"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"vision.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision.image_size ({self.image_size}) must be a multiple of "
                             f"patch_size ({self.patch_size})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision.hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class LayerNorm(nn.Cell):
    """LayerNorm over the last axis, in fp32, with HF's ``weight``/``bias`` names."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,)), name="weight")
        self.bias = Parameter(initializer("zeros", (dim,)), name="bias")
        self.eps = eps

    def construct(self, x):
        x32 = x.astype(ms.float32)
        mean = ops.mean(x32, -1, keep_dims=True)
        var = ops.mean(ops.square(x32 - mean), -1, keep_dims=True)
        return ((x32 - mean) * ops.rsqrt(var + self.eps) * self.weight + self.bias).astype(x.dtype)


class SelfAttention(nn.Cell):
    """Multi-head self-attention without a mask (every patch sees every patch)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj = (Linear(dim, dim, True) for _ in range(3))
        self.o_proj = Linear(dim, dim, True)
        self.scale = self.head_dim ** -0.5

    def construct(self, x):
        """x (B, N, D) → (B, N, D)."""
        b, n, d = x.shape
        q = self.q_proj(x).reshape(b, n, self.heads, self.head_dim).transpose(0, 2, 1, 3)  # (B, h, N, hd)
        k = self.k_proj(x).reshape(b, n, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        probs = ops.softmax(ops.matmul(q, k.transpose(0, 1, 3, 2)).astype(ms.float32) * self.scale, -1)
        out = ops.matmul(probs.astype(v.dtype), v)  # (B, h, N, hd)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, d))


class MLP(nn.Cell):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = Linear(dim, hidden, True), Linear(hidden, dim, True)

    def construct(self, x):
        return self.fc2(ops.gelu(self.fc1(x), approximate="none"))


class Block(nn.Cell):
    """Pre-norm transformer block; with ``temporal`` also attention across frames (video)."""

    def __init__(self, config: VisionConfig, temporal: bool = False):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.norm1, self.attn = LayerNorm(d, eps), SelfAttention(d, config.num_attention_heads)
        self.temporal = temporal
        if temporal:
            self.norm_t, self.temporal_attn = LayerNorm(d, eps), SelfAttention(d, config.num_attention_heads)
        self.norm2, self.mlp = LayerNorm(d, eps), MLP(d, config.intermediate_size)
        self.frames = config.num_frames

    def construct(self, x):
        """x (B·T, N, D): spatial attention within each frame, then (video) across the T frames."""
        x = x + self.attn(self.norm1(x))
        if self.temporal:
            bt, n, d = x.shape
            b = bt // self.frames
            xt = x.reshape(b, self.frames, n, d).transpose(0, 2, 1, 3).reshape(b * n, self.frames, d)
            xt = xt + self.temporal_attn(self.norm_t(xt))  # (B·N, T, D)
            x = xt.reshape(b, n, self.frames, d).transpose(0, 2, 1, 3).reshape(bt, n, d)
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Cell):
    """ViT over images (B, 3, H, W), or over videos (B, T, 3, H, W) when ``num_frames`` > 1.

    Returns patch features (B, N, D) for images, (B, T·N, D) for video.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        c, p, d = config.num_channels, config.patch_size, config.hidden_size
        self.patch_embed = Linear(c * p * p, d, True)  # a stride-p conv written as a matmul
        # Fixed-start sin-cos tables (MAE's), learnable: a N(0, 0.02) start hides where a patch is.
        grid = config.image_size // p
        rows, cols = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
        pos = np.concatenate([sincos(rows.reshape(-1), d // 2), sincos(cols.reshape(-1), d - d // 2)], 1)
        self.pos_embed = Parameter(Tensor(pos[None].astype(np.float32)), name="pos_embed")  # (1, N, D)
        self.video = config.num_frames > 1
        if self.video:
            frames = sincos(np.arange(config.num_frames), d)
            self.time_embed = Parameter(Tensor(frames[None, :, None].astype(np.float32)), name="time_embed")
        self.blocks = nn.CellList([Block(config, self.video) for _ in range(config.num_hidden_layers)])
        self.norm = LayerNorm(d, config.layer_norm_eps)
        self.grid, self.patch = config.image_size // p, p

    def construct(self, pixel_values):
        x = pixel_values
        frames = 1
        if self.video:
            frames = x.shape[1]
            x = x.reshape((-1,) + x.shape[2:])  # (B·T, 3, H, W)
        bt, c = x.shape[0], x.shape[1]
        g, p = self.grid, self.patch
        patches = x.reshape(bt, c, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(bt, g * g, c * p * p)
        h = self.patch_embed(patches) + self.pos_embed  # (B·T, N, D)
        if self.video:
            d = h.shape[-1]
            h = (h.reshape(-1, frames, g * g, d) + self.time_embed).reshape(bt, g * g, d)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        return h.reshape(-1, frames * g * g, h.shape[-1])  # (B, T·N, D)


def sincos(positions: np.ndarray, dim: int) -> np.ndarray:
    """(len(positions), dim) sin/cos features at frequencies 1/10000^(2i/dim)."""
    freqs = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) * 2 / dim)
    angles = positions[:, None].astype(np.float64) * freqs[None]
    out = np.concatenate([np.sin(angles), np.cos(angles)], 1)
    return np.pad(out, ((0, 0), (0, dim - out.shape[1])))


class Projector(nn.Cell):
    """Vision features (B, N, Dv) → LM width (B, N, H): Linear → GELU → Linear (LLaVA's)."""

    def __init__(self, vision_size: int, text_size: int):
        super().__init__()
        self.linear_1, self.linear_2 = Linear(vision_size, text_size, True), Linear(text_size, text_size, True)

    def construct(self, x):
        return self.linear_2(ops.gelu(self.linear_1(x), approximate="none"))


# HF ViTModel name → mindqwen name (data). ``{i}`` is a block index.
VIT_HF_KEYS = {
    "embeddings.patch_embeddings.projection.weight": "patch_embed.weight",
    "embeddings.patch_embeddings.projection.bias": "patch_embed.bias",
    "embeddings.position_embeddings": "pos_embed",
    "encoder.layer.{i}.layernorm_before.weight": "blocks.{i}.norm1.weight",
    "encoder.layer.{i}.layernorm_before.bias": "blocks.{i}.norm1.bias",
    "encoder.layer.{i}.attention.attention.query.weight": "blocks.{i}.attn.q_proj.weight",
    "encoder.layer.{i}.attention.attention.query.bias": "blocks.{i}.attn.q_proj.bias",
    "encoder.layer.{i}.attention.attention.key.weight": "blocks.{i}.attn.k_proj.weight",
    "encoder.layer.{i}.attention.attention.key.bias": "blocks.{i}.attn.k_proj.bias",
    "encoder.layer.{i}.attention.attention.value.weight": "blocks.{i}.attn.v_proj.weight",
    "encoder.layer.{i}.attention.attention.value.bias": "blocks.{i}.attn.v_proj.bias",
    "encoder.layer.{i}.attention.output.dense.weight": "blocks.{i}.attn.o_proj.weight",
    "encoder.layer.{i}.attention.output.dense.bias": "blocks.{i}.attn.o_proj.bias",
    "encoder.layer.{i}.layernorm_after.weight": "blocks.{i}.norm2.weight",
    "encoder.layer.{i}.layernorm_after.bias": "blocks.{i}.norm2.bias",
    "encoder.layer.{i}.intermediate.dense.weight": "blocks.{i}.mlp.fc1.weight",
    "encoder.layer.{i}.intermediate.dense.bias": "blocks.{i}.mlp.fc1.bias",
    "encoder.layer.{i}.output.dense.weight": "blocks.{i}.mlp.fc2.weight",
    "encoder.layer.{i}.output.dense.bias": "blocks.{i}.mlp.fc2.bias",
    "layernorm.weight": "norm.weight",
    "layernorm.bias": "norm.bias",
}
_PATTERNS = [(re.compile("^" + re.escape(k).replace(r"\{i\}", r"(\d+)") + "$"), v) for k, v in VIT_HF_KEYS.items()]


def vit_key(hf_name: str) -> str:
    """The mindqwen name of an HF ViT tensor (prefix ``vit.`` allowed); KeyError if unknown."""
    name = hf_name[len("vit."):] if hf_name.startswith("vit.") else hf_name
    for pattern, target in _PATTERNS:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group(1)) if m.groups() else target
    raise KeyError(hf_name)


def load_vit_weights(encoder: VisionEncoder, tensors: Dict[str, np.ndarray], source: str = "<dict>") -> None:
    """Load an HF ViT state dict into ``encoder``. The conv patch kernel (D, 3, p, p) becomes the
    matmul weight (D, 3·p·p) in the same (channel, row, column) order; the CLS token and its
    position are dropped (mindqwen's encoder keeps patch tokens only).

    Raises:
        ValueError: naming ``source`` and the tensor, for an unknown name, a missing tensor or a
            wrong shape.
    """
    params = {p.name: p for p in encoder.get_parameters()}
    prefix = next(n for n in params if n.endswith("pos_embed"))[:-len("pos_embed")]  # "vision." once fused
    seen: Dict[str, np.ndarray] = {}
    for hf_name, value in tensors.items():
        if hf_name.endswith("cls_token") or hf_name.startswith("pooler."):
            continue
        try:
            name = prefix + vit_key(hf_name)
        except KeyError:
            raise ValueError(f"{source}: {hf_name}: not a ViT tensor mindqwen knows") from None
        value = np.asarray(value, np.float32)
        if name.endswith("patch_embed.weight"):
            value = value.reshape(value.shape[0], -1)
        if name.endswith("pos_embed") and value.shape[1] == params[name].shape[1] + 1:
            value = value[:, 1:]  # drop the CLS position
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(f"{source}: {hf_name}: shape {value.shape}, the encoder expects {params[name].shape}")
        seen[name] = value
    missing = sorted(set(n for n in params if ".lora_" not in n) - set(seen))
    if missing:
        raise ValueError(f"{source}: missing ViT tensors for {missing[:5]}{' …' if len(missing) > 5 else ''}")
    for name, value in seen.items():  # only once everything checked out: a bad file changes nothing
        params[name].set_data(Tensor(value).astype(params[name].dtype))
