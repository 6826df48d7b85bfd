"""Qwen2 / Qwen2.5 / Qwen3 / Qwen3.5 causal LM, dense or mixture-of-experts, as MindSpore Cells, read top
to bottom. Qwen3.5's layers mix tokens by attention or by Gated DeltaNet (``models/deltanet.py``), as
``config.layer_types`` says.

Parameter names equal HF's (``model.layers.0.self_attn.q_proj.weight`` …), so an HF checkpoint
loads through the identity key map. ``construct`` methods are tensor math only; every check
lives in ``QwenConfig.__post_init__``. Runs in GRAPH_MODE and PYNATIVE_MODE.

Numerics follow HF: RMSNorm and rotary in fp32, attention softmax in fp32, loss in fp32; the
matmuls run in the parameters' dtype. On Ascend the fused kernels (``ops.rms_norm``,
``ops.flash_attention_score``) replace the hand-written RMSNorm and attention; on CPU, where
they do not exist, the hand-written path is used.

The building blocks (Linear, RMSNorm, MLP) are in ``models/layers.py``, the mixture-of-experts block in
``models/moe.py``, the chunked loss and scoring heads in ``models/heads.py``, the compile-once grouping of
the decoder layers in ``models/graph.py``.
"""
from __future__ import annotations

import math
import os
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from mindqwen.config import IGNORE_INDEX, ExecutionOptions, QwenConfig
from mindqwen.io import convert, hf
from mindqwen.io.experts import stack_experts
from mindqwen.io.safetensors import CheckpointError
from mindqwen.models.deltanet import GatedDeltaNet
from mindqwen.models.graph import apply_options, invalidate_compiled_graphs, low_dtype, share_layer_graphs
from mindqwen.models.heads import (ChunkedCrossEntropy, ChunkedCrossEntropyInForward, TokenLogProbs,
                                   TokenLogProbsInForward, label_log_probs, label_scores, label_scores_in_blocks)
from mindqwen.models.layers import (MLP, Embedding, Linear, RMSNorm, default_use_fused_ops, joined_weights,
                                    split_weights)
from mindqwen.models.moe import SparseMoeBlock, dropped_share, load_balancing_loss

# Finite "minus infinity" for masked attention scores: a fully masked row (left padding)
# then softmaxes to a uniform row instead of NaN.
MASK_VALUE = -1e9


class RotaryEmbedding(nn.Cell):
    """cos/sin (B, 1, S, D) for the HF rotate-half convention, in fp32, at any position.

    The angles are position × inv_freq in fp32, rounded as HF rounds them; their cos/sin are
    taken in float64 and rounded to fp32 where the device has float64 kernels (the CPU), so they
    do not rest on a device's fp32 cos/sin (MindSpore 2.10's CPU ones measured correctly rounded
    too here, in 18–30% less time). They are computed per call, not gathered from a precomputed
    table: a table for Qwen's 128k context (131072 × 128, cos and sin in fp32) is 134 MB of graph
    constants for positions most calls never reach, and still ends at its length; the per-call
    cost is B·S·D/2 cos and sin, measured ~65 ms at S = 32768 (D = 128) on 2 CPU cores against
    seconds for the layers of such a forward, and no measurable change in decode speed.

    ``table_length`` N (``ExecutionOptions.rotary_table``) gathers positions 0..N-1 from a table
    built once in float64 instead: exported graphs, whose cache holds N positions, then carry no
    float64 op and no raw angle for a fp16 conversion to lose.

    ``dynamic`` NTK scaling stretches the base when a row's longest position exceeds
    ``max_position_embeddings``, so its frequencies are computed in the graph per call and row:
    stateless, unlike HF's cached buffer, and a row's own, where HF takes the batch's longest.
    """

    def __init__(self, config: QwenConfig, table_length: Optional[int] = None, float64: bool = True):
        """table_length: positions of a precomputed table; None computes cos/sin per call.
        float64: cos/sin of the fp32 angles in float64 (devices with float64 kernels)."""
        super().__init__()
        inv_freq, scaling = config.rope_inv_freq()
        self.inv_freq_np, self.scaling = inv_freq, float(scaling)
        self.inv_freq = Tensor(inv_freq)  # (D/2,)
        self.float64 = float64
        rs = config.rope_scaling or {}
        self.dynamic = rs.get("rope_type") == "dynamic"
        self.factor = float(rs.get("factor", 1.0))
        self.max_positions = float(config.max_position_embeddings)
        self.theta = float(config.rope_theta)
        d = config.head_dim
        self.exponent = Tensor(np.arange(0, d, 2, dtype=np.float32) / np.float32(d))
        self.base_power = d / (d - 2)
        # The original Qwen's dynamic NTK at inference: alpha = max(2^ceil(log2(len / seq_length) + 1) - 1, 1),
        # base × alpha^(d/(d-2)). ceil(log2(len / seq_length)), or 0 within seq_length, is the number of
        # doublings of seq_length below len: counted exactly (a float log2 misses the powers of two).
        self.qwen_ntk = config.use_dynamic_ntk
        self.doublings = Tensor(float(config.seq_length or 1) * 2.0 ** np.arange(32, dtype=np.float64), ms.float32)
        self.table_length = None
        self.set_table_length(table_length)

    def apply_options(self, options: ExecutionOptions) -> None:
        self.set_table_length(options.rotary_table)

    def set_table_length(self, length: Optional[int]) -> None:
        """Gather from a table of ``length`` positions (None: compute per call); the table is
        built here, once per length."""
        if length == self.table_length:
            return
        self.table_length = length
        if length is None:
            self.cos_table = self.sin_table = None
            return
        positions = np.arange(length, dtype=np.float32)
        freqs = np.concatenate([np.outer(positions, self.inv_freq_np)] * 2, -1)  # (N, D) fp32 angles, as HF
        self.cos_table = Tensor((np.cos(freqs.astype(np.float64)).astype(np.float32) * np.float32(self.scaling)))
        self.sin_table = Tensor((np.sin(freqs.astype(np.float64)).astype(np.float32) * np.float32(self.scaling)))

    def construct(self, position_ids):
        """position_ids (B, S) int32 → cos, sin (B, 1, S, D) fp32."""
        if self.qwen_ntk and not self.training:
            length = position_ids.max().astype(ms.float32) + 1
            doublings = ops.reduce_sum((length > self.doublings).astype(ms.float32))  # 0 within seq_length
            alpha = ops.pow(2.0, doublings + 1) - 1
            freqs = position_ids.astype(ms.float32).expand_dims(-1) / ops.pow(
                self.theta * ops.pow(alpha, self.base_power), self.exponent)  # (B, S, D/2)
            return self._cos_sin(freqs, 1.0)
        if self.dynamic:
            # Each row's own longest position, so a row in a batch computes what it computes alone.
            pos = position_ids.astype(ms.float32)
            seq_len = ops.maximum(pos.max(axis=1, keepdims=True) + 1, self.max_positions)  # (B, 1)
            base = self.theta * ops.pow(self.factor * seq_len / self.max_positions
                                        - (self.factor - 1), self.base_power)
            inv_freq = 1.0 / ops.pow(base.expand_dims(-1), self.exponent)  # (B, 1, D/2)
            return self._cos_sin(pos.expand_dims(-1) * inv_freq, self.scaling)  # (B, S, D/2) angles
        if self.table_length is not None:
            cos = ops.gather(self.cos_table, position_ids, 0)  # (B, S, D)
            sin = ops.gather(self.sin_table, position_ids, 0)
            return cos.expand_dims(1), sin.expand_dims(1)
        freqs = position_ids.astype(ms.float32).expand_dims(-1) * self.inv_freq  # (B, S, D/2) fp32 angles, as HF
        return self._cos_sin(freqs, self.scaling)

    def _cos_sin(self, freqs, scaling: float):
        """freqs (B, S, D/2) fp32 angles → cos, sin (B, 1, S, D) fp32, times ``scaling``."""
        if self.float64 and self.table_length is None:
            angles = freqs.astype(ms.float64)
            cos, sin = ops.cos(angles).astype(ms.float32), ops.sin(angles).astype(ms.float32)
        else:
            cos, sin = ops.cos(freqs), ops.sin(freqs)
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        return ops.cat((cos, cos), -1).expand_dims(1), ops.cat((sin, sin), -1).expand_dims(1)


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


def apply_rotary(x, cos, sin):
    """x (..., D) rotated by cos/sin (..., R): the first R dims (R < D: partial rotary), the rest as they are."""
    x32, r = x.astype(ms.float32), cos.shape[-1]
    if r == x.shape[-1]:
        return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)
    rot = x32[..., :r]
    return ops.cat((rot * cos + rotate_half(rot) * sin, x32[..., r:]), -1).astype(x.dtype)


def query_key_tables(cos, sin, position_ids, logn_length: int):
    """The original Qwen's logn attention: queries beyond ``logn_length`` scaled by
    log_logn_length(position + 1), folded into the queries' rotary tables (rotary is linear).
    Returns cos, sin (B, 2, S, D): index 0 for queries, 1 for keys (``Attention._project``)."""
    p = position_ids.astype(ms.float32) + 1
    scale = ops.maximum(ops.log(p) / math.log(logn_length), 1.0).expand_dims(1).expand_dims(-1)  # (B, 1, S, 1)
    return ops.cat((cos * scale, cos), 1), ops.cat((sin * scale, sin), 1)


class Attention(nn.Cell):
    """Grouped-query attention with optional qkv bias (Qwen2) and q/k RMSNorm (Qwen3); in a hybrid
    model (Qwen3.5) gated: ``q_proj`` gives each head its query and a gate, [query | gate] (2·D per
    head), and the heads' output is multiplied by sigmoid(gate) before ``o_proj``.

    The n_rep query heads that share one KV head are stacked along the sequence axis, so a
    single batched matmul serves the whole group and K/V are never copied n_rep times:

        q (B, N, S, D) ──reshape──► (B, KV, n_rep·S, D) ─┐
        k (B, KV, S, D) ────────────────────────────────┴─► scores (B, KV, n_rep·S, S)
        scores ─► (B, KV, n_rep, S, S) + mask (B, 1, 1, S, S) ─► softmax (fp32)
        probs (B, KV, n_rep·S, S) · v (B, KV, S, D) ─► (B, KV, n_rep·S, D) ─► (B, N, S, D)

    Head h uses KV head h // n_rep, as HF's ``repeat_kv`` does.
    """

    def __init__(self, config: QwenConfig, layer_idx: int, dtype=ms.float32,
                 use_fused_ops: bool = False):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, d)
        self.n_rep = config.n_rep
        self.gated = config.is_hybrid
        self.q_proj = Linear(h, self.num_heads * d * (2 if self.gated else 1), config.qkv_bias, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * d, config.qkv_bias, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * d, config.qkv_bias, dtype)
        self.o_proj = Linear(self.num_heads * d, h, config.o_bias, dtype)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, use_fused_ops, config.is_hybrid)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, use_fused_ops, config.is_hybrid)
        self.sliding = config.layer_types[layer_idx] == "sliding_attention"
        # Flash attention has no sliding-window mask input here: those layers stay hand-written.
        self.use_flash = use_fused_ops and not self.sliding
        self.scale = d ** -0.5
        self.bmm_qk = ops.BatchMatMul(transpose_b=True)  # primitives, so tensor parallel can shard them
        self.bmm_pv = ops.BatchMatMul()

    def parts(self) -> tuple:
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj) + ((self.q_norm, self.k_norm) if self.qk_norm else ())

    def weights(self) -> tuple:
        """q, k, v, o projections' weights (and the q/k norms'), flat."""
        return joined_weights(self.parts())

    def construct(self, x, cos, sin, mask):
        return self.apply(self.weights(), x, cos, sin, mask)

    def apply(self, w, x, cos, sin, mask):
        """x (B, S, H); cos/sin (B, 1 or 2, S, D): index 0 rotates queries, the last keys;
        mask (B, 1, S, S) bool, True = not attended; w: ``weights()``."""
        w = split_weights(w, self.parts())
        q, k, v, gate = self._project(w, x, cos, sin)
        if self.use_flash:
            # Packed samples reach the kernel as this full mask too. Its variable-length layout
            # ("TND", actual_seq_qlen / actual_seq_kvlen) would skip the blocks between samples,
            # but takes one length per sample with none empty: the number of samples would be a
            # shape that changes from batch to batch (a recompile each). Not used; neither path
            # is verified here (no Ascend).
            out = ops.flash_attention_score(q, k, v, self.num_heads, attn_mask=mask.astype(ms.uint8),
                                            scalar_value=self.scale, input_layout="BNSD")
        else:
            out = self._attend(q, k, v, mask)
        return self._output(w, out, gate)

    def cached(self, x, cos, sin, mask, k_cache, v_cache, cache_position):
        """The KV-cache step: write this step's keys/values at ``cache_position`` and attend
        over the whole cache.

        x (B, T, H); cos/sin (B, 1, T, D); mask (B, 1, T, MAX) bool, True = not attended;
        k_cache/v_cache (B, KV, MAX, D); cache_position (B, T) int32, the slots each row writes.
        Returns the output (B, T, H) and the updated caches (new tensors: no Parameter state,
        so one graph serves eager generation and the exported MindIR alike).
        """
        return self.apply_cached(self.weights(), x, cos, sin, mask, k_cache, v_cache, cache_position)

    def apply_cached(self, w, x, cos, sin, mask, k_cache, v_cache, cache_position):
        """``cached`` with ``weights()`` w."""
        w = split_weights(w, self.parts())
        q, k, v, gate = self._project(w, x, cos, sin)
        b, kv, t, d = k.shape
        slots = ops.broadcast_to(cache_position.reshape(b, 1, t, 1), (b, kv, t, d))
        k_cache = ops.tensor_scatter_elements(k_cache, slots, k.astype(k_cache.dtype), 2)
        v_cache = ops.tensor_scatter_elements(v_cache, slots, v.astype(v_cache.dtype), 2)
        out = self._attend(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
        return self._output(w, out, gate), k_cache, v_cache

    def _project(self, w, x, cos, sin):
        """x (B, S, H) → q (B, N, S, D), k and v (B, KV, S, D), rotary applied, and the output
        gate (B, S, N·D) of a gated attention (else None)."""
        b, s, _ = x.shape
        q = self.q_proj.apply(w[0], x)
        gate = None
        if self.gated:  # per head [query | gate]
            q = q.reshape(b, s, self.num_heads, 2 * self.head_dim)
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:].reshape(b, s, -1)
        q = q.reshape(b, s, self.num_heads, self.head_dim)  # (B, S, N, D)
        k = self.k_proj.apply(w[1], x).reshape(b, s, self.num_kv_heads, self.head_dim)  # (B, S, KV, D)
        v = self.v_proj.apply(w[2], x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.apply(w[4], q), self.k_norm.apply(w[5], k)
        q = apply_rotary(q.transpose(0, 2, 1, 3), cos[:, :1], sin[:, :1])  # (B, N, S, D)
        k = apply_rotary(k.transpose(0, 2, 1, 3), cos[:, -1:], sin[:, -1:])  # (B, KV, S, D)
        return q, k, v.transpose(0, 2, 1, 3), gate

    def _output(self, w, out, gate):
        """out (B, N, S, D) (gate (B, S, N·D) or None) → o_proj (B, S, H)."""
        b, _, s, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(b, s, self.num_heads * self.head_dim)
        if gate is not None:
            out = out * ops.sigmoid(gate)
        return self.o_proj.apply(w[3], out)

    def _attend(self, q, k, v, mask):
        b, _, s, d = q.shape
        t = k.shape[2]
        q = q.reshape(b, self.num_kv_heads, self.n_rep * s, d)  # (B, KV, n_rep·S, D)
        scores = self.bmm_qk(q, k).astype(ms.float32) * self.scale  # (B, KV, n_rep·S, T)
        scores = scores.reshape(b, self.num_kv_heads, self.n_rep, s, t)
        # Additive, not masked_fill: MindSpore's CPU MaskedFill kernels keep per-element index
        # buffers for their lifetime (~1 GB at 8 layers × 512 tokens); the sum is exact.
        scores = scores + mask.expand_dims(1).astype(ms.float32) * MASK_VALUE
        probs = ops.softmax(scores, -1).astype(v.dtype)
        out = self.bmm_pv(probs.reshape(b, self.num_kv_heads, self.n_rep * s, t), v)
        return out.reshape(b, self.num_heads, s, d)  # (B, N, S, D)


class DecoderLayer(nn.Cell):
    """Pre-norm attention and MLP (or mixture of experts), each added to the residual stream. In a
    hybrid model (Qwen3.5) a ``linear_attention`` layer mixes tokens by Gated DeltaNet
    (``linear_attn``, ``models/deltanet.py``) instead of attention; its ``mask`` is the padding
    mask (B, S), 1 = token.

    With the model's ``compile_once`` option a dense layer runs as ``compiled_once`` /
    ``cached_once`` (``share_layer_graphs``): the same ``no_inline`` graph for every layer of the
    model with the same settings, called with each layer's weights, so graph mode compiles the
    layer once instead of once per layer (docs/performance.md).
    """

    def __init__(self, config: QwenConfig, layer_idx: int, dtype=ms.float32,
                 use_fused_ops: bool = False):
        super().__init__()
        eps, zero_centered = config.rms_norm_eps, config.is_hybrid
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, use_fused_ops, zero_centered)
        self.linear = config.layer_types[layer_idx] == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet.from_config(config, dtype, float64=not use_fused_ops)
        else:
            self.self_attn = Attention(config, layer_idx, dtype, use_fused_ops)
        self.sliding = not self.linear and self.self_attn.sliding
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, use_fused_ops, zero_centered)
        self.sparse = config.is_sparse(layer_idx)
        self.mlp = SparseMoeBlock(config, dtype) if self.sparse else MLP(config, dtype)
        self.use_fused_ops = use_fused_ops
        # Set by share_layer_graphs: the no_inline graphs this layer runs in training / forward
        # passes and in KV-cache steps (None: inlined), and the (signature, shareable) they were
        # chosen for.
        self.compiled_once, self.cached_once, self.signature = None, None, None

    @property
    def mixer(self) -> nn.Cell:
        """What mixes the tokens: ``self_attn`` or ``linear_attn``."""
        return self.linear_attn if self.linear else self.self_attn

    def parts(self) -> tuple:
        return self.input_layernorm, self.mixer, self.post_attention_layernorm, self.mlp

    def weights(self) -> tuple:
        """A dense layer's weights, flat: its norms', attention's and MLP's."""
        return joined_weights(self.parts())

    def construct(self, x, cos, sin, mask):
        """x (B, S, H) → (B, S, H); a mixture-of-experts layer also returns its router logits."""
        if self.sparse:
            return self._feed_forward(x + self._mix(self.input_layernorm(x), cos, sin, mask))
        if self.compiled_once is None:
            return self.apply(self.weights(), x, cos, sin, mask)
        return self.compiled_once(x, cos, sin, mask, *self.weights())

    def apply(self, w, x, cos, sin, mask):
        """A dense layer with ``weights()`` w."""
        w = split_weights(w, self.parts())
        h = self.input_layernorm.apply(w[0], x)
        x = x + (self.linear_attn.apply(w[1], h, mask) if self.linear else self.self_attn.apply(w[1], h, cos, sin, mask))
        return x + self.mlp.apply(w[3], self.post_attention_layernorm.apply(w[2], x))

    def cached(self, x, cos, sin, mask, k_cache, v_cache, cache_position):
        """``construct`` with the KV cache (see ``Attention.cached``); no router logits."""
        if self.sparse:
            a, k_cache, v_cache = self.self_attn.cached(self.input_layernorm(x), cos, sin, mask,
                                                        k_cache, v_cache, cache_position)
            return self._feed_forward(x + a)[0], k_cache, v_cache
        if self.cached_once is None:
            return self.apply_cached(self.weights(), x, cos, sin, mask, k_cache, v_cache, cache_position)
        return self.cached_once(x, cos, sin, mask, k_cache, v_cache, cache_position, *self.weights())

    def cached_state(self, x, keep, conv_state, recurrent_state):
        """A linear-attention layer's generation step: x (B, T, H) after the tokens that left
        conv_state (B, conv_dim, K−1) and recurrent_state (B, Hv, dk, dv); keep (B, T), 1 = a real
        token. Returns x (B, T, H) and the two states after x."""
        a, conv_state, recurrent_state = self.linear_attn.cached(self.input_layernorm(x), conv_state,
                                                                 recurrent_state, keep)
        x = x + a
        if self.sparse:
            return self._feed_forward(x)[0], conv_state, recurrent_state
        return self._feed_forward(x), conv_state, recurrent_state

    def apply_cached(self, w, x, cos, sin, mask, k_cache, v_cache, cache_position):
        """A dense layer's KV-cache step with ``weights()`` w."""
        w = split_weights(w, self.parts())
        a, k_cache, v_cache = self.self_attn.apply_cached(w[1], self.input_layernorm.apply(w[0], x), cos, sin, mask,
                                                          k_cache, v_cache, cache_position)
        x = x + a
        return x + self.mlp.apply(w[3], self.post_attention_layernorm.apply(w[2], x)), k_cache, v_cache

    def _mix(self, h, cos, sin, mask):
        return self.linear_attn(h, mask) if self.linear else self.self_attn(h, cos, sin, mask)

    def _feed_forward(self, x):
        if self.sparse:
            y, router_logits = self.mlp(self.post_attention_layernorm(x))
            return x + y, router_logits
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenModel(nn.Cell):
    """Embeddings → decoder layers → final RMSNorm."""

    def __init__(self, config: QwenConfig, dtype=ms.float32, use_fused_ops: bool = False,
                 compile_once: Optional[bool] = None):
        super().__init__()
        self.config = config
        self.compile_once = compile_once  # set_compile_once
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.CellList([DecoderLayer(config, i, dtype, use_fused_ops)
                                   for i in range(config.num_hidden_layers)])
        self.sync_with_weights()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, use_fused_ops, config.is_hybrid)
        self.rotary_emb = RotaryEmbedding(config, float64=not use_fused_ops)  # Ascend: fp32 cos/sin
        self.sliding_window = config.sliding_window or 0
        self.hidden_dtype = None
        self.logn_length = config.seq_length if config.use_logn_attn else 0  # the original Qwen

    def apply_options(self, options: ExecutionOptions) -> None:
        self.hidden_dtype = low_dtype(options.hidden_dtype)

    def sync_with_weights(self) -> bool:
        """Regroup the layers by signature (``share_layer_graphs``); whether any changed."""
        return share_layer_graphs(list(self.layers), self.compile_once)

    def set_compile_once(self, mode: Optional[bool] = True) -> None:
        """Compile equal decoder layers once (``mindspore.no_inline``) instead of once per layer.

        On the CPU this trades steady speed for start-up time (docs/performance.md, "Time to
        first step"). At the Qwen2.5-0.5B shape (24 layers): a LoRA step compiles in ~9 s instead
        of ~34 s for a step within noise of the inlined one (+3% on average), so ``None`` (auto,
        the default) shares the layers of models with frozen weights; a full fine-tune's 4-layer
        step is 36% slower shared, so its layers stay inlined. ``True`` also shares the KV-cache
        step: the first generated token after 5.9 s instead of 23.2 s, then 5.5 tokens/s instead
        of 9.6: worth it for a few answers in a notebook. ``False`` inlines every layer.
        """
        self.compile_once = mode if mode is None else bool(mode)
        invalidate_compiled_graphs(self)

    def construct(self, input_ids, attention_mask=None, output_hidden_states=False, position_ids=None):
        """input_ids (B, S) int32; attention_mask (B, S), 1 = token, 0 = padding (left or right);
        position_ids (B, S) int32: packed samples (see ``prepare``).

        Returns the normed last hidden state (B, S, H), and with ``output_hidden_states`` also
        the tuple HF returns: embeddings, the input of every later layer, the normed output.
        """
        x, hidden_states, _ = self.run(input_ids, attention_mask, position_ids)
        if output_hidden_states:
            return x, hidden_states
        return x

    def run(self, input_ids, attention_mask=None, position_ids=None):
        """The forward pass with everything it can report (inputs as ``prepare``'s). Graph mode
        drops what the caller does not use.

        Returns:
            ``hidden, hidden_states, router_logits``, unpacked by name at every call site:
            the normed last hidden state (B, S, H); HF's hidden_states tuple; the router logits
            of every mixture-of-experts layer (a tuple of (B·S, E) fp32; empty for a dense
            model). A plain tuple, not a NamedTuple: MindSpore 2.10 builds a NamedTuple in a
            compiled graph with a Python fallback (PyExecute) that stops the gradient.
        """
        x, cos, sin, masked, window_masked = self.prepare(input_ids, attention_mask, position_ids)
        keep = None
        if self.config.is_hybrid:  # linear attention zeroes the padding's inputs: (B, S, 1), 1 = token
            keep = ops.ones(input_ids.shape, x.dtype) if attention_mask is None else attention_mask.astype(x.dtype)
        hidden_states, router_logits = (), ()
        for layer in self.layers:
            hidden_states = hidden_states + (x,)
            x = layer(x, cos, sin, keep if layer.linear else window_masked if layer.sliding else masked)
            if layer.sparse:
                x, logits = x
                router_logits = router_logits + (logits,)
        x = self.norm(x)
        return x, hidden_states + (x,), router_logits

    def prepare(self, input_ids, attention_mask=None, position_ids=None):
        """Embeddings (B, S, H), rotary cos/sin (B, 1, S, D) and the masks (B, 1, S, S) of the
        full and the sliding-window layers: what every decoder layer takes.

        position_ids (B, S) int32, for rows packed with several samples: each token's position in
        its sample. A sample starts where its position is 0 (the varlen convention of HF and flash
        attention), and a token attends only to the earlier tokens of its own sample:

            position_ids  0 1 2 3 0 1 2 0 1      three samples (the last: a row's padding)
            sample        1 1 1 1 2 2 2 3 3      = cumsum(position_ids == 0)
            token 5 sees  · · · · ■ ■ · · ·      the keys of sample 2 up to itself

        None: the row is one sample, positions count its real tokens (``attention_mask``).
        """
        b, s = input_ids.shape
        idx = ops.arange(0, s, dtype=ms.int32)
        masked = idx.reshape(1, s) > idx.reshape(s, 1)  # (S_q, S_k): future keys
        if position_ids is not None:
            position_ids = position_ids.astype(ms.int32)
            sample = ops.cumsum((position_ids == 0).astype(ms.int32), 1)  # (B, S): samples begun so far
            other = sample.reshape(b, s, 1) != sample.reshape(b, 1, s)  # (B, S_q, S_k): another sample's key
            masked = ops.logical_or(masked.reshape(1, s, s), other).reshape(b, 1, s, s)
            if attention_mask is not None:
                masked = ops.logical_or(masked, (attention_mask == 0).reshape(b, 1, 1, s))
        elif attention_mask is None:
            position_ids = ops.broadcast_to(idx.reshape(1, s), (b, s))
            masked = ops.broadcast_to(masked.reshape(1, 1, s, s), (b, 1, s, s))
        else:
            # Positions count real tokens only, so a left-padded row equals its unpadded self.
            keep = attention_mask.astype(ms.int32)
            position_ids = ops.maximum(ops.cumsum(keep, 1) - 1, 0)
            masked = ops.logical_or(masked.reshape(1, 1, s, s), (keep == 0).reshape(b, 1, 1, s))
        window_masked = masked
        if self.sliding_window > 0:
            too_old = idx.reshape(s, 1) - idx.reshape(1, s) >= self.sliding_window
            window_masked = ops.logical_or(masked, too_old.reshape(1, 1, s, s))
        cos, sin = self.rotary_emb(position_ids)
        if self.logn_length and not self.training:
            cos, sin = query_key_tables(cos, sin, position_ids, self.logn_length)
        x = self.embed_tokens(input_ids)
        if self.hidden_dtype is not None:  # AMP O2/O3: the residual stream in low precision
            x = x.astype(self.hidden_dtype)
        return x, cos, sin, masked, window_masked

    def cached(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache,
               conv_state=None, recurrent_state=None):
        """One generation step over T new tokens with a static-shape KV cache.

        input_ids, position_ids (B, T) int32 (positions count real tokens only);
        attention_mask (B, MAX) int32, 1 = a real token in that cache slot (this step's included);
        cache_position (B, T) int32, the slots each row writes (its own write pointer, so rows
        that joined a running batch at different times share one static shape);
        k_cache/v_cache (L, B, KV, MAX, D), L the attention layers. A hybrid model's
        linear-attention layers keep fixed-size states instead (``models/kv_cache.py``):
        conv_state (L_linear, B, conv_dim, K−1) and recurrent_state (L_linear, B, Hv, dk, dv), fp32.
        Returns the normed hidden states (B, T, H) and the updated caches (and states).
        """
        x, cos, sin, masked, window_masked = self.prepare_cached(input_ids, position_ids, attention_mask,
                                                                 cache_position, k_cache.shape[3])
        keys, values, convs, recurrents = (), (), (), ()
        # One Unstack, not L StridedSlices: CPU StridedSlice on the 5-D cache costs ~1 ms each.
        k_layers, v_layers = ops.unstack(k_cache, 0), ops.unstack(v_cache, 0)
        conv_layers = recurrent_layers = keep = None
        if conv_state is not None:
            conv_layers, recurrent_layers = ops.unstack(conv_state, 0), ops.unstack(recurrent_state, 0)
            keep = ops.gather_elements(attention_mask, 1, cache_position).astype(x.dtype)  # (B, T): this step's tokens
        for layer in self.layers:
            if layer.linear:
                x, conv, recurrent = layer.cached_state(x, keep, conv_layers[len(convs)], recurrent_layers[len(convs)])
                convs, recurrents = convs + (conv,), recurrents + (recurrent,)
            else:
                x, k, v = layer.cached(x, cos, sin, window_masked if layer.sliding else masked,
                                       k_layers[len(keys)], v_layers[len(keys)], cache_position)
                keys, values = keys + (k,), values + (v,)
        if conv_state is None:
            return self.norm(x), ops.stack(keys), ops.stack(values)
        return self.norm(x), ops.stack(keys), ops.stack(values), ops.stack(convs), ops.stack(recurrents)

    def prepare_cached(self, input_ids, position_ids, attention_mask, cache_position, max_len: int):
        """``prepare`` for a cached step: embeddings (B, T, H), rotary cos/sin and the masks
        (B, 1, T, MAX) of the full and the sliding-window layers over the cache slots."""
        b, t = input_ids.shape
        slots = ops.arange(0, max_len, dtype=ms.int32)  # (MAX,)
        query, slots = cache_position.reshape(b, 1, t, 1), slots.reshape(1, 1, 1, -1)
        masked = ops.logical_or(slots > query,  # (B, 1, T, MAX): future slots
                                (attention_mask == 0).reshape(b, 1, 1, -1))
        window_masked = masked
        if self.sliding_window > 0:  # pads sit before every real token, so slot gaps = position gaps
            window_masked = ops.logical_or(masked, query - slots >= self.sliding_window)
        cos, sin = self.rotary_emb(position_ids)
        if self.logn_length and not self.training:
            cos, sin = query_key_tables(cos, sin, position_ids, self.logn_length)
        x = self.embed_tokens(input_ids)
        if self.hidden_dtype is not None:
            x = x.astype(self.hidden_dtype)
        return x, cos, sin, masked, window_masked


class QwenForCausalLM(nn.Cell):
    """Qwen decoder with a language-model head (tied to the embeddings or separate).

    ``model(input_ids)`` returns logits (B, S, V); ``model(input_ids, labels=labels)`` returns
    the mean next-token cross-entropy with HF shift semantics (labels -100 are ignored), plus
    ``router_aux_loss_coef`` × the load-balancing loss for a mixture of experts. With
    ``position_ids`` (B, S) a row holds several samples, each attending only to itself
    (``QwenModel.prepare``).
    """

    def __init__(self, config: QwenConfig, dtype=ms.float32, use_fused_ops: Optional[bool] = None,
                 compile_once: Optional[bool] = None, options: Optional[ExecutionOptions] = None):
        """compile_once: compile equal decoder layers once: True, False, None (auto: the layers of
        a model with frozen weights, in training and forward passes), ``QwenModel.set_compile_once``.
        options: how the model executes (precision, the chunked loss, …); later changes go through
        ``mindqwen.models.graph.configure``."""
        super().__init__()
        self.config = config
        if use_fused_ops is None:
            use_fused_ops = default_use_fused_ops()
        self.model = QwenModel(config, dtype, use_fused_ops, compile_once)
        self.tied = config.tie_word_embeddings
        if not self.tied:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.vocab_size = config.vocab_size
        # (rows, V) fp32 logit blocks (config.LOSS_CHUNK_ELEMENTS); rows = 0 (tensor parallel,
        # which shards ``head_matmul``) takes the loss over all rows at once.
        self.chunked_loss = ChunkedCrossEntropy(config.loss_chunk_rows)
        # Per-token log-probs by the same blocks (preference losses); None: with frozen weights
        # and a trained head, which only the whole-logits path differentiates.
        self.token_logps = TokenLogProbs(config.loss_chunk_rows)
        self.chunk_head = True  # whether the head is one matrix the chunked loss can take (sync_with_weights)
        # Mixture of experts: the training loss adds HF's load-balancing loss with this weight.
        self.aux_loss_coef = config.router_aux_loss_coef if config.num_experts else 0.0
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.moe_capacity_factor if config.num_experts else None
        self.capacity_multiple = 1  # SparseMoeBlock's, for the dropped share
        self.options = options or ExecutionOptions()
        apply_options(self, self.options)

    def apply_options(self, options: ExecutionOptions) -> None:
        self.capacity_multiple = options.capacity_multiple
        rows = self.config.loss_chunk_rows if options.loss_chunk_rows is None else options.loss_chunk_rows
        if rows != self.chunked_loss.rows:
            self.chunked_loss = type(self.chunked_loss)(rows, self.chunked_loss.weight_grad)
            if self.token_logps is not None:
                self.token_logps = type(self.token_logps)(rows)

    def sync_with_weights(self) -> bool:
        """The chunked loss for which weights train: a model with frozen weights forms its
        gradients in the forward (``ChunkedCrossEntropyInForward``), and dW only for a trained
        head. Whether it changed."""
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        frozen = any(not p.requires_grad for p in self.get_parameters())
        kind = ChunkedCrossEntropyInForward if frozen else ChunkedCrossEntropy
        token_kind = None if frozen and head.requires_grad else TokenLogProbsInForward if frozen else TokenLogProbs
        # An adapter (or a bias) on the head makes its logits more than one matrix product.
        chunk_head = self.tied or len(self.lm_head.weights()) == 1
        if (type(self.chunked_loss) is kind and self.chunked_loss.weight_grad == head.requires_grad
                and self.chunk_head == chunk_head and type(self.token_logps) is token_kind):
            return False
        self.chunked_loss = kind(self.chunked_loss.rows, head.requires_grad)
        self.token_logps = token_kind(self.chunked_loss.rows) if token_kind else None
        self.chunk_head = chunk_head
        return True

    def construct(self, input_ids, attention_mask=None, labels=None, position_ids=None):
        h, _, router_logits = self.model.run(input_ids, attention_mask, position_ids)
        if labels is None:
            return self.logits(h)
        loss = self.loss(h, labels)
        if self.aux_loss_coef:
            loss = loss + self.aux_loss_coef * load_balancing_loss(router_logits, self.top_k, attention_mask)
        return loss

    def aux_loss(self, input_ids, attention_mask=None):
        """A mixture of experts' load-balancing loss, unweighted (HF's ``aux_loss``; fp32 scalar)."""
        _, _, router_logits = self.model.run(input_ids, attention_mask)
        return load_balancing_loss(router_logits, self.top_k, attention_mask)

    def loss_and_aux_loss(self, input_ids, attention_mask, labels, position_ids=None):
        """A mixture of experts' training loss (``model(input_ids, attention_mask, labels,
        position_ids)``), the unweighted load-balancing loss it includes and, with
        ``moe_capacity_factor``, the share of assignments dropped (``dropped_share``): what ``fit`` logs."""
        h, _, router_logits = self.model.run(input_ids, attention_mask, position_ids)
        aux = load_balancing_loss(router_logits, self.top_k, attention_mask)
        loss = self.loss(h, labels) + self.aux_loss_coef * aux
        if self.capacity_factor is None:
            return loss, aux
        return loss, aux, dropped_share(router_logits, self.top_k, self.capacity_factor, self.capacity_multiple)

    def cached(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache, *states):
        """KV-cache step (see ``QwenModel.cached``): next-token logits (B, V) fp32 at the last
        of the T positions, and the updated caches (L, B, KV, MAX, D) (a hybrid model's
        linear-attention states after them: ``states``, conv then recurrent)."""
        out = self.model.cached(input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache, *states)
        return (self.last_logits(out[0]),) + out[1:]

    @property
    def cache_dtype(self):
        """The dtype the KV cache is kept in: the residual stream's."""
        return self.model.hidden_dtype or self.model.embed_tokens.weight.dtype

    def last_logits(self, h):
        """h (B, T, H) → the logits (B, V) fp32 at the last position."""
        logits = self.logits(h[:, -1:])  # (B, 1, V); a reshape, not a slice, drops the axis
        return logits.reshape(logits.shape[0], -1).astype(ms.float32)

    def logits(self, h):
        """h (B, S, H) → logits (B, S, V)."""
        if self.tied:
            w = self.model.embed_tokens.weight
            return self.head_matmul(h.reshape(-1, h.shape[-1]), w).reshape(h.shape[:-1] + (-1,))
        return self.lm_head(h)

    def loss(self, h, labels):
        """Mean cross-entropy of the logits at h[:, t] against labels[:, t+1], ignoring -100, in fp32.

        h (B, S, H) is sliced before the LM head, so no vocabulary-sized slice (and its gradient)
        is made. The (T, V) fp32 logits are never whole (``ChunkedCrossEntropy``), except under
        tensor parallel (``chunked_loss.rows`` = 0) or with an adapter on ``lm_head``
        (``chunk_head``), where log-softmax and a gather run over all rows at once.
        """
        shift_labels = labels[:, 1:].reshape(-1).astype(ms.int32)  # (T,)
        count = ops.maximum(ops.reduce_sum((shift_labels != IGNORE_INDEX).astype(ms.float32)), 1.0)
        if self.chunked_loss.rows and self.chunk_head:
            return self.chunked_loss(*self._head_operands(h), shift_labels) / count
        shift_logits = self.logits(h[:, :-1]).reshape(-1, self.vocab_size).astype(ms.float32)  # (T, V)
        return -ops.reduce_sum(label_log_probs(shift_logits, shift_labels)) / count

    def token_log_probs(self, input_ids, labels, differentiable: bool = True, attention_mask=None,
                        temperature: float = 1.0):
        """Each labelled next token's log-probability: input_ids, labels (R, S) → (R, S−1) fp32,
        at t the log p of labels[:, t+1] (HF shift), 0 where it is -100. Taken block by block
        (``TokenLogProbs``) as the loss is, so the (R, S, V) logits are never whole;
        ``differentiable=False`` forms no gradient (a reference model's pass). ``attention_mask``
        (R, S): 0 on padding (left-padded prompts); ``temperature``: of the distribution sampled
        from, logits / T (the hidden state is divided: the head has no bias)."""
        h, _, _ = self.model.run(input_ids, attention_mask)
        if temperature != 1.0:
            h = h / temperature
        shift_labels = labels[:, 1:].reshape(-1).astype(ms.int32)  # (T,)
        if self.chunked_loss.rows and self.chunk_head and self.token_logps is not None:
            h2, w = self._head_operands(h)
            values = (self.token_logps(h2, w, shift_labels) if differentiable
                      else self.token_logps.token_values(h2, w, shift_labels))
        else:
            logits = self.logits(h[:, :-1]).reshape(-1, self.vocab_size).astype(ms.float32)  # (T, V)
            values = label_log_probs(logits, shift_labels).reshape(-1)
        return values.reshape(input_ids.shape[0], -1)

    def score_tokens(self, input_ids, targets, last):
        """What an evaluation asks of each row (a harness's log-likelihood requests):
        input_ids, targets (R, S) int32, targets[:, t] the token that follows input_ids[:, :t+1]
        (-100: not asked) → its log-prob (R, S) fp32 (0 where not asked), whether it is the
        argmax (R, S) bool (True where not asked), and the whole log-distribution that follows
        position last[r] (R, V) fp32, for scoring several one-token continuations of a row at
        once. Block by block like the loss: the (R, S, V) logits are never whole."""
        h, _, _ = self.model.run(input_ids, None)
        r, s, hidden = h.shape
        flat = targets.reshape(-1).astype(ms.int32)  # (R·S,)
        if self.chunked_loss.rows and self.chunk_head:
            h2 = h.reshape(-1, hidden)
            w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
            if not self.tied and self.lm_head.compute_dtype is not None:
                h2, w = h2.astype(self.lm_head.compute_dtype), w.astype(self.lm_head.compute_dtype)
            values, greedy = label_scores_in_blocks(h2, w, flat, self.chunked_loss.rows)
        else:
            values, greedy = label_scores(self.logits(h).reshape(-1, self.vocab_size).astype(ms.float32), flat)
        rows = ops.gather(h.reshape(-1, hidden), ops.arange(r, dtype=ms.int32) * s + last.astype(ms.int32), 0)
        after_last = ops.log_softmax(self.logits(rows.reshape(r, 1, hidden)).reshape(r, -1).astype(ms.float32), -1)
        return values.reshape(r, s), greedy.reshape(r, s), after_last

    def _head_operands(self, h):
        """h (B, S, H) → the rows that predict a next token, h[:, :-1] (T, H), and the head matrix
        W (V, H), in the head's compute dtype (AMP O1: a low-precision head)."""
        h2 = h[:, :-1].reshape(-1, h.shape[-1])
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        if not self.tied and self.lm_head.compute_dtype is not None:
            h2, w = h2.astype(self.lm_head.compute_dtype), w.astype(self.lm_head.compute_dtype)
        return h2, w

    @classmethod
    def from_pretrained(cls, folder: str, dtype: str = "float32", allow_non_finite: bool = False,
                        **overrides) -> "QwenForCausalLM":
        """Build the model of an HF folder (config.json + safetensors, single or sharded).

        Args:
            dtype: parameter dtype: "float32", "float16" or "bfloat16" (not on CPU, which has no
                bf16 kernels). bf16 files widen to fp32 exactly.
            allow_non_finite: load tensors holding NaN or inf (else ``CheckpointError`` naming them).
            **overrides: ``QwenConfig`` fields over the folder's config.json, as HF's keyword
                arguments (e.g. ``moe_capacity_factor=1.25``).
        """
        hf.check_dtype(dtype, ms.get_context("device_target"))
        if not os.path.isdir(folder):
            raise CheckpointError(f"{folder}: checkpoint folder not found")
        config = QwenConfig.from_hf(folder).replace(**overrides)
        with hf.no_init_parameters():  # the checkpoint replaces every weight: one copy in RAM
            model = cls(config, dtype=hf.DTYPES[dtype][0])
        if config.model_type == "qwen":  # the original Qwen's own layout (fused c_attn, transformer.h.*)
            model._set_state(convert.read_checkpoint(folder, allow_non_finite=allow_non_finite)[1])
        else:
            hf.load_weights(model, folder, allow_non_finite=allow_non_finite)
        return model

    @classmethod
    def from_checkpoint(cls, source: str, fmt: str = "hf", config: Optional[str] = None, qkv: Optional[str] = None,
                        mlp: Optional[str] = None, allow_non_finite: bool = False) -> "QwenForCausalLM":
        """Build the model of a checkpoint in any format ``mindqwen convert`` reads (an HF folder,
        a ``.ckpt``, mindformers' legacy or Mcore names, fused or not; ``config``: the HF folder
        or config.json when ``source`` has none; ``qkv`` / ``mlp``: fused layouts)."""
        cfg, state = convert.read_checkpoint(source, fmt, config, qkv, mlp, allow_non_finite)
        with hf.no_init_parameters():
            model = cls(cfg)
        model._set_state(state)
        return model

    def _set_state(self, state) -> None:
        """Every parameter from ``state`` (HF name → lazy tensor, checked against the config)."""
        state = dict(state)
        state.update(stack_experts(state, "stacked", self.config.num_experts))
        for p in self.get_parameters():
            p.set_data(Tensor(state[p.name].load()).astype(p.dtype))

    def save_pretrained(self, folder: str, dtype: Optional[str] = None,
                        max_shard_size: str = "5GB") -> None:
        """Write an HF folder (config.json + safetensors) that transformers loads unchanged (the
        original Qwen in its own layout)."""
        hf.save_pretrained(self, folder, dtype=dtype, max_shard_size=max_shard_size,
                           layout=lambda tensors: convert.own_layout(tensors, self.config))


from_pretrained = QwenForCausalLM.from_pretrained  # mindqwen.from_pretrained
