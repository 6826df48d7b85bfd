"""Gated cross-attention: text hidden states attend to vision tokens, added through a tanh gate
that starts at zero, so a freshly fused model computes exactly what the text model computes.

    text x (B, S, H) ──RMSNorm──► q_proj ─► q_norm ─┐
    vision v (B, Nv, H) ──────► k_proj ─► k_norm ─┴─► softmax(q·kᵀ/√d) · v_proj(v) ─► o_proj ─► × tanh(gate) ─► + x
                                                                                                (gate = 0 at init)

``q_norm`` and ``k_norm`` (RMSNorm over each head, as in Llama 3.2 Vision and Qwen3) bound the
attention logits. Without them, vision tokens an order of magnitude larger than the text states
saturate the softmax at the start and the block learns only what every vision token shares (in the
shapes demo: the colour, never the position).

``vision_mask`` (B, S, 1) is 1 on the text positions allowed to see the image (from the image
placeholder on; see ``mindqwen.multimodal.data``) and 0 before it.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

from mindqwen.models.layers import Linear, RMSNorm


class GatedCrossAttention(nn.Cell):
    """Cross-attention block placed after a decoder layer (its own keys: ``cross_attn.<i>.*``).

    Args:
        hidden_size: the language model's width (vision tokens are projected to it first).
        num_heads: attention heads (``hidden_size`` must divide by it).
        eps: RMSNorm epsilon (the LM's).
    """

    def __init__(self, hidden_size: int, num_heads: int, eps: float = 1e-6):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"cross-attention: hidden_size {hidden_size} is not divisible by {num_heads} heads")
        self.heads, self.head_dim = num_heads, hidden_size // num_heads
        self.norm = RMSNorm(hidden_size, eps)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(hidden_size, hidden_size, False) for _ in range(4))
        self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.gate = Parameter(initializer("zeros", (1,)), name="gate")
        self.scale = self.head_dim ** -0.5

    def construct(self, x, vision, vision_mask):
        """x (B, S, H), vision (B, Nv, H), vision_mask (B, S, 1) → x + tanh(gate)·attention."""
        k, v = self.keys_values(vision)
        return self.attend(x, k, v, vision_mask)

    def keys_values(self, vision):
        """vision (B, Nv, H) → keys (normed) and values (B, heads, Nv, D): what generation
        computes once per image and keeps beside the KV cache."""
        b, n, _ = vision.shape
        k = self.k_norm(self.k_proj(vision).reshape(b, n, self.heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(vision).reshape(b, n, self.heads, self.head_dim).transpose(0, 2, 1, 3)
        return k, v

    def attend(self, x, k, v, vision_mask):
        """x (B, S, H), k/v (B, heads, Nv, D), vision_mask (B, S, 1) → x + tanh(gate)·attention."""
        b, s, h = x.shape
        q = self.q_norm(self.q_proj(self.norm(x)).reshape(b, s, self.heads, self.head_dim)).transpose(0, 2, 1, 3)
        probs = ops.softmax(ops.matmul(q, k.transpose(0, 1, 3, 2)).astype(ms.float32) * self.scale, -1)
        out = ops.matmul(probs.astype(v.dtype), v).transpose(0, 2, 1, 3).reshape(b, s, h)
        return x + ops.tanh(self.gate).astype(x.dtype) * self.o_proj(out) * vision_mask.astype(x.dtype)
