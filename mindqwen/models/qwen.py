"""Qwen2 / Qwen2.5 / Qwen3 causal LM, dense or mixture-of-experts, as MindSpore Cells, read top to bottom.

Parameter names equal HF's (``model.layers.0.self_attn.q_proj.weight`` …), so an HF checkpoint
loads through the identity key map. ``construct`` methods are tensor math only; every check
lives in ``QwenConfig.__post_init__``. Runs in GRAPH_MODE and PYNATIVE_MODE.

Numerics follow HF: RMSNorm and rotary in fp32, attention softmax in fp32, loss in fp32; the
matmuls run in the parameters' dtype. On Ascend the fused kernels (``ops.rms_norm``,
``ops.flash_attention_score``) replace the hand-written RMSNorm and attention; on CPU, where
they do not exist, the hand-written path is used.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Initializer, initializer

from mindqwen.config import ExecutionOptions, QwenConfig
from mindqwen.io import convert, hf
from mindqwen.io.experts import stack_experts
from mindqwen.io.safetensors import CheckpointError
from mindqwen.models.graph import apply_options, invalidate_compiled_graphs, low_dtype

# Finite "minus infinity" for masked attention scores: a fully masked row (left padding)
# then softmaxes to a uniform row instead of NaN.
MASK_VALUE = -1e9
IGNORE_INDEX = -100
INIT_STD = 0.02


class RandomNormal(Initializer):
    """N(0, sigma²) in float32, drawn by numpy's SFC64 generators on every core: ~140 M values/s
    on 2 CPU cores against ~28 M for MindSpore's ``Normal`` (a random Qwen2.5-1.5B shape is 1.5 G).

    A tensor is seeded by one draw from numpy's global generator, as MindSpore's initializers are
    (so ``mindspore.set_seed`` fixes the weights), and drawn in blocks of ``BLOCK`` values, each
    from its own child seed: the values do not depend on the number of threads. Lazy under
    ``no_init_parameters`` like any initializer.
    """

    BLOCK = 1 << 22

    def __init__(self, sigma: float):
        super().__init__(sigma=sigma)
        self.sigma = sigma

    def _initialize(self, arr):
        out = arr if arr.dtype == np.float32 and arr.flags.c_contiguous else np.empty(arr.shape, np.float32)
        flat = out.reshape(-1)
        blocks = [flat[i:i + self.BLOCK] for i in range(0, flat.size, self.BLOCK)]
        seeds = np.random.SeedSequence(int(np.random.randint(0, 2**63 - 1, dtype=np.int64))).spawn(len(blocks))
        list(_draw_pool().map(self._draw, seeds, blocks))  # numpy releases the GIL while drawing
        if out is not arr:
            arr[...] = out

    def _draw(self, seed: np.random.SeedSequence, block: np.ndarray) -> None:
        np.random.Generator(np.random.SFC64(seed)).standard_normal(out=block, dtype=np.float32)
        block *= np.float32(self.sigma)


@functools.lru_cache(maxsize=1)
def _draw_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="mindqwen-init")


def joined_weights(cells: tuple) -> tuple:
    """The ``weights()`` of ``cells`` one after the other, flat (``split_weights`` undoes it)."""
    w = ()
    for cell in cells:
        w = w + cell.weights()
    return w


def split_weights(w: tuple, cells: tuple) -> tuple:
    """w: the ``weights()`` of ``cells`` one after the other, flat → one tuple per cell. (Weights
    travel flat: MindSpore 2.10 failed to differentiate a ``no_inline`` graph whose argument is a
    tuple of tuples beside a Cell with its own ``bprop``.)"""
    out, start = (), 0
    for cell in cells:
        n = len(cell.weights())
        out = out + (w[start:start + n],)
        start = start + n
    return out


def default_use_fused_ops() -> bool:
    """Fused Ascend kernels are used only when MindSpore targets Ascend."""
    return ms.get_context("device_target") == "Ascend"


class Linear(nn.Cell):
    """y = x·Wᵀ + b with the HF layout ``weight`` [out, in].

    ``compute_dtype`` (``ExecutionOptions``) runs the matmul in that dtype and returns the
    input's dtype, so a fp32 residual stream can use fp16 matmuls (AMP O1).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype=ms.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(initializer(RandomNormal(INIT_STD), (out_features, in_features), dtype),
                                name="weight")
        self.bias = Parameter(initializer("zeros", (out_features,), dtype), name="bias") if bias else None
        self.matmul = ops.MatMul(transpose_b=True)  # no transposed copy of the weight
        self.compute_dtype = None

    def apply_options(self, options: ExecutionOptions) -> None:
        self.compute_dtype = low_dtype(options.compute_dtype)

    def weights(self) -> tuple:
        return (self.weight,) if self.bias is None else (self.weight, self.bias)

    def construct(self, x):
        return self.apply(self.weights(), x)

    def apply(self, w, x):
        """x (..., in) with ``weights()`` w → (..., out)."""
        x2, weight = x.reshape(-1, self.in_features), w[0]  # x2: (B*S, in)
        if self.compute_dtype is not None:
            x2, weight = x2.astype(self.compute_dtype), weight.astype(self.compute_dtype)
        y = self.matmul(x2, weight)  # (B*S, out)
        if self.bias is not None:
            y = y + w[1].astype(y.dtype)
        return y.reshape(x.shape[:-1] + (self.out_features,)).astype(x.dtype)


class Embedding(nn.Cell):
    def __init__(self, vocab_size: int, hidden_size: int, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(RandomNormal(INIT_STD), (vocab_size, hidden_size), dtype),
                                name="weight")

    def construct(self, input_ids):
        return ops.gather(self.weight, input_ids, 0)  # (B, S, H)


class RMSNorm(nn.Cell):
    """weight · x / sqrt(mean(x²) + eps), computed in fp32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype=ms.float32, use_fused_ops: bool = False):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), dtype), name="weight")
        self.eps, self.use_fused_ops = eps, use_fused_ops

    def weights(self) -> tuple:
        return (self.weight,)

    def construct(self, x):
        return self.apply(self.weights(), x)

    def apply(self, w, x):
        weight = w[0]
        if self.use_fused_ops:
            return ops.rms_norm(x, weight, self.eps)[0]
        x32 = x.astype(ms.float32)
        y = x32 * ops.rsqrt(ops.mean(x32 * x32, -1, keep_dims=True) + self.eps)
        return weight * y.astype(x.dtype)


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
    x32 = x.astype(ms.float32)
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)


def query_key_tables(cos, sin, position_ids, logn_length: int):
    """The original Qwen's logn attention: queries beyond ``logn_length`` scaled by
    log_logn_length(position + 1), folded into the queries' rotary tables (rotary is linear).
    Returns cos, sin (B, 2, S, D): index 0 for queries, 1 for keys (``Attention._project``)."""
    p = position_ids.astype(ms.float32) + 1
    scale = ops.maximum(ops.log(p) / math.log(logn_length), 1.0).expand_dims(1).expand_dims(-1)  # (B, 1, S, 1)
    return ops.cat((cos * scale, cos), 1), ops.cat((sin * scale, sin), 1)


class Attention(nn.Cell):
    """Grouped-query attention with optional qkv bias (Qwen2) and q/k RMSNorm (Qwen3).

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
        self.q_proj = Linear(h, self.num_heads * d, config.qkv_bias, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * d, config.qkv_bias, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * d, config.qkv_bias, dtype)
        self.o_proj = Linear(self.num_heads * d, h, config.o_bias, dtype)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, use_fused_ops)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, use_fused_ops)
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
        q, k, v = self._project(w, x, cos, sin)
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
        return self._output(w, out)

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
        q, k, v = self._project(w, x, cos, sin)
        b, kv, t, d = k.shape
        slots = ops.broadcast_to(cache_position.reshape(b, 1, t, 1), (b, kv, t, d))
        k_cache = ops.tensor_scatter_elements(k_cache, slots, k.astype(k_cache.dtype), 2)
        v_cache = ops.tensor_scatter_elements(v_cache, slots, v.astype(v_cache.dtype), 2)
        out = self._attend(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask)
        return self._output(w, out), k_cache, v_cache

    def _project(self, w, x, cos, sin):
        """x (B, S, H) → q (B, N, S, D), k and v (B, KV, S, D), rotary applied."""
        b, s, _ = x.shape
        q = self.q_proj.apply(w[0], x).reshape(b, s, self.num_heads, self.head_dim)  # (B, S, N, D)
        k = self.k_proj.apply(w[1], x).reshape(b, s, self.num_kv_heads, self.head_dim)  # (B, S, KV, D)
        v = self.v_proj.apply(w[2], x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.apply(w[4], q), self.k_norm.apply(w[5], k)
        q = apply_rotary(q.transpose(0, 2, 1, 3), cos[:, :1], sin[:, :1])  # (B, N, S, D)
        k = apply_rotary(k.transpose(0, 2, 1, 3), cos[:, -1:], sin[:, -1:])  # (B, KV, S, D)
        return q, k, v.transpose(0, 2, 1, 3)

    def _output(self, w, out):
        """out (B, N, S, D) → o_proj (B, S, H)."""
        b, _, s, _ = out.shape
        return self.o_proj.apply(w[3], out.transpose(0, 2, 1, 3).reshape(b, s, self.num_heads * self.head_dim))

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


class MLP(nn.Cell):
    """SwiGLU: down(silu(gate(x)) · up(x)); width ``intermediate_size`` unless given (experts)."""

    def __init__(self, config: QwenConfig, dtype=ms.float32, intermediate_size: Optional[int] = None):
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = Linear(h, i, False, dtype)
        self.up_proj = Linear(h, i, False, dtype)
        self.down_proj = Linear(i, h, False, dtype)

    def parts(self) -> tuple:
        return self.gate_proj, self.up_proj, self.down_proj

    def weights(self) -> tuple:
        return joined_weights(self.parts())

    def construct(self, x):
        return self.apply(self.weights(), x)

    def apply(self, w, x):
        w = split_weights(w, self.parts())
        return self.down_proj.apply(w[2], ops.silu(self.gate_proj.apply(w[0], x)) * self.up_proj.apply(w[1], x))


class Router(nn.Cell):
    """The expert router ``mlp.gate``: logits x·Gᵀ in fp32 whatever the precision level, so
    that low-precision rounding never changes which experts a token goes to."""

    def __init__(self, hidden_size: int, num_experts: int, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer(RandomNormal(INIT_STD), (num_experts, hidden_size), dtype), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        """x (N, H) → router logits (N, E) fp32."""
        return self.matmul(x.astype(ms.float32), self.weight.astype(ms.float32))


class ExpertLinear(nn.Cell):
    """One projection of all E experts of a layer, stacked: ``weight`` [E, out, in], whose slice e
    is HF's ``mlp.experts.{e}.<proj>.weight`` (``mindqwen.io.experts`` stacks and splits them).

    A handful of matmuls for all experts instead of E (compile time at 64-128 experts), and the
    [E, ·, ·] tensor that expert parallel splits by expert. Three forms:
    ``construct`` runs each expert on its own tokens (E, T, in) → (E, T, out); ``fan_out`` runs
    every expert on every token (N, in) → (N, E, out); ``fan_in`` sums the experts' outputs
    (N, E, in) → (N, out). The last two are single 2-D matmuls over the experts side by side.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, dtype=ms.float32):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.weight = Parameter(initializer(RandomNormal(INIT_STD), (num_experts, out_features, in_features), dtype),
                                name="weight")
        self.bmm = ops.BatchMatMul(transpose_b=True)
        self.matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = None  # as Linear's

    def apply_options(self, options: ExecutionOptions) -> None:
        self.compute_dtype = low_dtype(options.compute_dtype)

    def construct(self, x):
        """x (E, T, in) → (E, T, out): expert e's tokens through expert e's weight."""
        x3, w = self._cast(x, self.weight)
        return self.bmm(x3, w).astype(x.dtype)

    def fan_out(self, x2):
        """x2 (N, in) → (N, E, out): every expert on every token, one (N, in)·(in, E·out) matmul."""
        x2c, w = self._cast(x2, self.weight)
        y = self.matmul(x2c, w.reshape(-1, self.in_features))  # (N, E·out)
        return y.reshape(x2.shape[0], self.num_experts, self.out_features).astype(x2.dtype)

    def fan_in(self, h):
        """h (N, E, in) → Σ_e h[:, e]·W[e]ᵀ (N, out), one (N, E·in)·(E·in, out) matmul."""
        hc, w = self._cast(h, self.weight)
        w = w.transpose(1, 0, 2).reshape(self.out_features, -1)  # (out, E·in)
        return self.matmul(hc.reshape(h.shape[0], -1), w).astype(h.dtype)

    def _cast(self, x, w):
        if self.compute_dtype is not None:
            return x.astype(self.compute_dtype), w.astype(self.compute_dtype)
        return x, w


class Experts(nn.Cell):
    """The routed SwiGLU experts of a layer (``mlp.experts``), stacked."""

    def __init__(self, config: QwenConfig, dtype=ms.float32):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = ExpertLinear(e, h, i, dtype)
        self.up_proj = ExpertLinear(e, h, i, dtype)
        self.down_proj = ExpertLinear(e, i, h, dtype)

    def construct(self, x):
        """x (E, T, H) → (E, T, H): expert e on its own T tokens."""
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))

    def weighted_sum(self, x2, weights):
        """x2 (N, H), weights (N, E) → Σ_e w[:, e]·expert_e(x2) (N, H): every expert on every
        token, weighted before the (linear) down projection so the sum over experts is one matmul."""
        h = ops.silu(self.gate_proj.fan_out(x2)) * self.up_proj.fan_out(x2)  # (N, E, I)
        return self.down_proj.fan_in(h * weights.expand_dims(-1))


class SparseMoeBlock(nn.Cell):
    """Mixture of SwiGLU experts (Qwen2-MoE, Qwen3-MoE), with Qwen2-MoE's gated shared expert.

        p = softmax(router(x))  (N, E) fp32;  the k largest p of a token pick its experts,
        renormalised to sum 1 when ``norm_topk_prob``;  w (N, E) holds them, 0 elsewhere
        y = Σ_e w[:, e] · expert_e(x)  (+ sigmoid(shared_expert_gate(x)) · shared_expert(x))

    Every expert runs on every token and is weighted by w (0 for the tokens that did not pick it):
    static shapes, no token ever dropped, and an expert no token picked gets an exact zero
    gradient. Training with ``moe_capacity_factor`` f, expert e runs only on the C = ceil(f·N·k/E)
    tokens with the largest w[:, e], gathered into an (E, C, H) batch, and its outputs are summed
    back per token: exact while no expert is picked by more than C tokens (measured on CPU,
    forward and backward; docs/performance.md).
    """

    def __init__(self, config: QwenConfig, dtype=ms.float32):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.capacity_factor = config.moe_capacity_factor
        # Under semi-auto parallel (ExecutionOptions, set by shard_model) the exact path runs the
        # experts as (E, N, H) batches too: one shard layout of the stacked weights in every graph;
        # and the capacity is a multiple of the devices that split an expert group's tokens.
        self.batched = False
        self.capacity_multiple = 1
        self.gate = Router(config.hidden_size, config.num_experts, dtype)
        self.experts = Experts(config, dtype)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = MLP(config, dtype, config.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, False, dtype)

    def apply_options(self, options: ExecutionOptions) -> None:
        self.batched, self.capacity_multiple = options.batched_experts, options.capacity_multiple

    def construct(self, x):
        """x (B, S, H) → y (B, S, H) and the router logits (B·S, E) fp32."""
        x2 = x.reshape(-1, x.shape[-1])  # (N, H)
        router_logits, weights = self.route(x2)
        weights = weights.astype(x.dtype)  # (N, E)
        if self.capacity_factor is not None and self.training:
            y = self._within_capacity(x2, weights.swapaxes(0, 1))
        elif self.batched:
            ye = self.experts(ops.broadcast_to(x2, (self.num_experts,) + x2.shape))  # (E, N, H)
            y = (ye * weights.swapaxes(0, 1).expand_dims(-1)).sum(0)
        else:
            y = self.experts.weighted_sum(x2, weights)
        if self.has_shared_expert:
            y = y + ops.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return y.reshape(x.shape), router_logits

    def route(self, x2):
        """x2 (N, H) → the router logits (N, E) fp32 and each token's expert weights w (N, E)
        fp32: its k largest probabilities (renormalised with ``norm_topk_prob``), 0 elsewhere."""
        router_logits = self.gate(x2)
        probs = ops.softmax(router_logits, -1)  # (N, E)
        # Indices only, then a gather: differentiating through topk's (values, indices) pair
        # fails in MindSpore 2.10's graph mode ("func graph is empty"); the gradient is the same.
        chosen = ops.stop_gradient(ops.topk(probs, self.top_k)[1])  # (N, k): the experts each token picks
        top = ops.gather_elements(probs, 1, chosen)  # (N, k): their probabilities
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdims=True)
        weights = (ops.one_hot(chosen, self.num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32))
                   * top.expand_dims(-1)).sum(1)  # (N, E)
        return router_logits, weights

    def _within_capacity(self, x2, weights):
        """x2 (N, H), weights (E, N) → Σ_e w[e] · expert_e(x) over each expert's C tokens of
        largest weight (tokens that did not pick e have weight 0: they add nothing)."""
        n, e = x2.shape[0], self.num_experts
        capacity = expert_capacity(n, self.top_k, e, self.capacity_factor, self.capacity_multiple)
        rows = ops.stop_gradient(ops.topk(weights, capacity)[1])  # (E, C) token indices
        xe = ops.gather(x2, rows.reshape(-1), 0).reshape(e, capacity, -1)  # (E, C, H)
        ye = self.experts(xe) * ops.gather_elements(weights, 1, rows).expand_dims(-1)  # (E, C, H)
        return ops.unsorted_segment_sum(ye.reshape(e * capacity, -1), rows.reshape(-1), n)


def expert_capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float, multiple: int = 1) -> int:
    """C = ceil(f · N · k / E) tokens per expert, rounded up to a multiple of ``multiple``, at most N."""
    return min(tokens, -(-math.ceil(capacity_factor * tokens * top_k / num_experts) // multiple) * multiple)


def dropped_share(router_logits, top_k: int, capacity_factor: float, multiple: int = 1):
    """The share of a batch's (token, expert) assignments that ``moe_capacity_factor`` dropped,
    over all MoE layers: Σ_e max(count_e − C, 0) / (N·k) per layer, averaged. router_logits: a
    tuple of (N, E) fp32, one per MoE layer."""
    logits = ops.stop_gradient(ops.stack(router_logits))  # (L, N, E)
    n, num_experts = logits.shape[1], logits.shape[2]
    capacity = expert_capacity(n, top_k, num_experts, capacity_factor, multiple)
    chosen = ops.topk(logits, top_k)[1]  # (L, N, k): softmax keeps the order
    counts = ops.one_hot(chosen, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32)).sum((1, 2))  # (L, E)
    return ops.relu(counts - capacity).sum() / (logits.shape[0] * n * top_k)


def load_balancing_loss(router_logits, top_k: int, attention_mask=None):
    """HF's auxiliary load-balancing loss over all MoE layers together (Switch Transformer):

        E · Σ_e f_e · P_e,  f_e = fraction of tokens that picked expert e (Σ_e f_e = k),
                            P_e = mean router probability of e,

    both averaged over the tokens of every layer at once (attention_mask (B, S): padding left out).
    router_logits: a tuple of (B·S, E) fp32, one per MoE layer.
    """
    logits = ops.stack(router_logits)  # (L, N, E)
    num_experts = logits.shape[-1]
    probs = ops.softmax(logits, -1)
    chosen = ops.stop_gradient(ops.topk(probs, top_k)[1])  # (L, N, k)
    routed = ops.one_hot(chosen, num_experts, ops.ones((), ms.float32), ops.zeros((), ms.float32)).sum(2)  # (L, N, E)
    if attention_mask is None:
        keep = ops.ones(probs.shape[:2] + (1,), ms.float32)
    else:
        keep = ops.broadcast_to(attention_mask.reshape(1, -1, 1).astype(ms.float32), probs.shape[:2] + (1,))
    tokens = ops.reduce_sum(keep)
    share = ops.reduce_sum(routed * keep, (0, 1)) / tokens  # (E,) f_e
    prob = ops.reduce_sum(probs * keep, (0, 1)) / tokens  # (E,) P_e
    return ops.reduce_sum(share * prob) * num_experts


class DecoderLayer(nn.Cell):
    """Pre-norm attention and MLP (or mixture of experts), each added to the residual stream.

    With the model's ``compile_once`` option a dense layer runs as ``compiled_once`` /
    ``cached_once`` (``share_layer_graphs``): the same ``no_inline`` graph for every layer of the
    model with the same settings, called with each layer's weights, so graph mode compiles the
    layer once instead of once per layer (docs/performance.md).
    """

    def __init__(self, config: QwenConfig, layer_idx: int, dtype=ms.float32,
                 use_fused_ops: bool = False):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, use_fused_ops)
        self.self_attn = Attention(config, layer_idx, dtype, use_fused_ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, use_fused_ops)
        self.sparse = config.is_sparse(layer_idx)
        self.mlp = SparseMoeBlock(config, dtype) if self.sparse else MLP(config, dtype)
        self.use_fused_ops = use_fused_ops
        # Set by share_layer_graphs: the no_inline graphs this layer runs in training / forward
        # passes and in KV-cache steps (None: inlined), and the (signature, shareable) they were
        # chosen for.
        self.compiled_once, self.cached_once, self.signature = None, None, None

    def parts(self) -> tuple:
        return self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp

    def weights(self) -> tuple:
        """A dense layer's weights, flat: its norms', attention's and MLP's."""
        return joined_weights(self.parts())

    def construct(self, x, cos, sin, mask):
        """x (B, S, H) → (B, S, H); a mixture-of-experts layer also returns its router logits."""
        if self.sparse:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
            return self._feed_forward(x)
        if self.compiled_once is None:
            return self.apply(self.weights(), x, cos, sin, mask)
        return self.compiled_once(x, cos, sin, mask, *self.weights())

    def apply(self, w, x, cos, sin, mask):
        """A dense layer with ``weights()`` w."""
        w = split_weights(w, self.parts())
        x = x + self.self_attn.apply(w[1], self.input_layernorm.apply(w[0], x), cos, sin, mask)
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

    def apply_cached(self, w, x, cos, sin, mask, k_cache, v_cache, cache_position):
        """A dense layer's KV-cache step with ``weights()`` w."""
        w = split_weights(w, self.parts())
        a, k_cache, v_cache = self.self_attn.apply_cached(w[1], self.input_layernorm.apply(w[0], x), cos, sin, mask,
                                                          k_cache, v_cache, cache_position)
        x = x + a
        return x + self.mlp.apply(w[3], self.post_attention_layernorm.apply(w[2], x)), k_cache, v_cache

    def _feed_forward(self, x):
        if self.sparse:
            y, router_logits = self.mlp(self.post_attention_layernorm(x))
            return x + y, router_logits
        return x + self.mlp(self.post_attention_layernorm(x))


def share_layer_graphs(layers, mode: Optional[bool] = None) -> bool:
    """Give dense layers the ``no_inline`` graphs of their signature, made from the first layer
    with that signature: the forward (``compiled_once``) where ``_shareable``, the KV-cache step
    (``cached_once``). ``mode`` True shares both, False neither, None (auto) the forward of layers
    with frozen weights (LoRA's training) and no KV-cache step: where the CPU's numbers favour it
    (docs/performance.md, "Time to first step"). Returns whether any layer's changed. On Ascend
    the layers are marked for ``lazy_inline`` instead, always. Called when the model is built,
    whenever its compiled graphs are invalidated (``invalidate_compiled_graphs``) and when a
    ``Stepper`` is built."""
    if layers and layers[0].use_fused_ops:
        return _mark_lazy_inline(layers)
    states = [_share_plan(layer, mode) for layer in layers]
    if all(layer.signature == state for layer, state in zip(layers, states)):
        return False
    graphs = {}
    for layer, (sig, forward, cached) in zip(layers, states):
        if sig is not None and sig not in graphs:
            graphs[sig] = _compile_once(layer)
        shared = graphs.get(sig, (None, None))
        layer.compiled_once, layer.cached_once = shared[0] if forward else None, shared[1] if cached else None
        layer.signature = (sig, forward, cached)
    return True


def _share_plan(layer: "DecoderLayer", mode: Optional[bool]) -> tuple:
    """(signature or None, share the forward, share the KV-cache step) for ``share_layer_graphs``."""
    if layer.sparse or mode is False:
        return None, False, False
    frozen = any(not p.requires_grad for p in layer.get_parameters())
    forward, cached = _shareable(layer) and (mode or frozen), bool(mode)
    return (layer_signature(layer) if forward or cached else None), forward, cached


def _mark_lazy_inline(layers) -> bool:
    """Ascend: what ``mindspore.lazy_inline`` does to a Cell, per layer: layers with equal keys
    compile to one reusable subgraph. (The decorator keys on the constructor's arguments, which
    hold the layer index; the signature is what makes two layers the same graph.) Verified on CPU
    only as far as the marking: the compile itself needs Ascend."""
    changed = False
    for layer in layers:
        key = "lazy_inline_DecoderLayer_" + hashlib.sha256(repr(layer_signature(layer)).encode()).hexdigest()[:16]
        changed = changed or getattr(layer, "cell_init_args", None) != key
        layer.cell_init_args = key
    return changed


def _shareable(layer: "DecoderLayer") -> bool:
    """Whether a dense layer's forward may be shared: not marked for recompute (recompute is a
    property of each layer's own graph). Its KV-cache step has no gradients and no such limit."""
    if layer.sparse or layer.use_fused_ops:
        return False
    return not any(getattr(cell, "_has_config_recompute", False) for _, cell in layer.cells_and_names())


def _compile_once(template: DecoderLayer) -> tuple:
    """The ``no_inline`` forward and KV-cache step of the layers with ``template``'s signature.
    Frozen weights (LoRA's base) go through ``stop_gradient``: the shared backward is one graph
    for every caller, and would otherwise form their gradients for nothing (+24% step time, +26%
    memory at Qwen2.5-0.5B LoRA, benchmarks/no_inline_layer.py)."""
    frozen = tuple(not p.requires_grad for p in template.weights())

    @ms.no_inline
    def decoder_layer(x, cos, sin, mask, *w):
        w = tuple(ops.stop_gradient(t) if stop else t for t, stop in zip(w, frozen))
        return template.apply(w, x, cos, sin, mask)

    @ms.no_inline
    def decoder_layer_cached(x, cos, sin, mask, k_cache, v_cache, cache_position, *w):
        return template.apply_cached(w, x, cos, sin, mask, k_cache, v_cache, cache_position)
    return decoder_layer, decoder_layer_cached


# Cell attributes that are bookkeeping, MindSpore's or the grouping's own: they differ between
# layers that compute the same thing.
# ``training`` too: set_train sets it on the whole model, and MindSpore keys compiled graphs by it.
_BOOKKEEPING = frozenset({"is_top_cell", "arguments_key", "phase", "grad_ops_label", "cell_init_args",
                          "compiled_once", "cached_once", "signature", "training"})
_SETTING_TYPES = (bool, int, float, str, type(None), type(ms.float32).__mro__[-3])  # ... and MindSpore dtypes


def layer_signature(layer: nn.Cell) -> tuple:
    """Everything a layer's graph is compiled from except its weights' values: each sub-cell's
    type and settings, and each weight's shape, dtype and whether it trains. Two layers with
    equal signatures run the same graph."""
    parts = []
    for name, cell in layer.cells_and_names():
        settings = tuple(sorted((key, repr(value)) for key, value in vars(cell).items()
                                if not key.startswith("_") and key not in _BOOKKEEPING
                                and isinstance(value, _SETTING_TYPES)))
        weights = tuple((tuple(p.shape), str(p.dtype), p.requires_grad) for p in cell.get_parameters(expand=False))
        parts.append((name, type(cell), settings, weights))
    return tuple(parts)


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
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, use_fused_ops)
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
        hidden_states, router_logits = (), ()
        for layer in self.layers:
            hidden_states = hidden_states + (x,)
            x = layer(x, cos, sin, window_masked if layer.self_attn.sliding else masked)
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

    def cached(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache):
        """One generation step over T new tokens with a static-shape KV cache.

        input_ids, position_ids (B, T) int32 (positions count real tokens only);
        attention_mask (B, MAX) int32, 1 = a real token in that cache slot (this step's included);
        cache_position (B, T) int32, the slots each row writes (its own write pointer, so rows
        that joined a running batch at different times share one static shape);
        k_cache/v_cache (L, B, KV, MAX, D).
        Returns the normed hidden states (B, T, H) and the updated caches.
        """
        x, cos, sin, masked, window_masked = self.prepare_cached(input_ids, position_ids, attention_mask,
                                                                 cache_position, k_cache.shape[3])
        keys, values = (), ()
        # One Unstack, not L StridedSlices: CPU StridedSlice on the 5-D cache costs ~1 ms each.
        k_layers, v_layers = ops.unstack(k_cache, 0), ops.unstack(v_cache, 0)
        for i, layer in enumerate(self.layers):
            x, k, v = layer.cached(x, cos, sin, window_masked if layer.self_attn.sliding else masked,
                                   k_layers[i], v_layers[i], cache_position)
            keys, values = keys + (k,), values + (v,)
        return self.norm(x), ops.stack(keys), ops.stack(values)

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


def _label_log_probs(logits, labels):
    """logits (T, V) fp32, labels (T,) int32 → log p(label) (T, 1), 0 where the label is ignored."""
    keep = (labels != IGNORE_INDEX).reshape(-1, 1)
    safe = ops.select(keep, labels.reshape(-1, 1), ops.zeros_like(labels.reshape(-1, 1)))
    return ops.gather_elements(ops.log_softmax(logits, -1), 1, safe) * keep.astype(ms.float32)


def _label_scores(logits, labels):
    """logits (T, V) fp32, labels (T,) int32 → log p(label) (T,), 0 where ignored, and whether
    the label is the argmax (T,) bool, True where ignored: what an evaluation asks of a token."""
    keep = labels != IGNORE_INDEX
    greedy = ops.logical_or(ops.argmax(logits, -1).astype(ms.int32) == labels, ops.logical_not(keep))
    return _label_log_probs(logits, labels).reshape(-1), greedy


_MATMUL_NT = ops.MatMul(transpose_b=True)  # h (r, H) · W (V, H)ᵀ
_MATMUL_NN = ops.MatMul()  # dlogits (r, V) · W (V, H)
_MATMUL_TN = ops.MatMul(transpose_a=True)  # dlogits (r, V)ᵀ · h (r, H)


class _LogitBlocks(nn.Cell):
    """The cross-entropy of the logits h·Wᵀ taken ``rows`` rows at a time, so no pass holds more
    than one (rows, V) fp32 block of logits (the chunked cross-entropy of torchtune and Liger):
    its value, and its gradients formed block by block from each block's softmax p, with c = dout
    for kept rows, 0 for ignored ones:

        dlogits = c·(p − onehot(label))                       (rows, V), one block at a time
        dh      = c·p·W − c·W[label]                          (rows, H)
        dW     += (c·p)ᵀ·h, then −c·h scattered to the label rows   (V, H)

    ``weight_grad``: whether the head trains (``QwenForCausalLM.sync_with_weights``).
    """

    def __init__(self, rows: int, weight_grad: bool = True):
        super().__init__()
        self.rows, self.weight_grad = rows, weight_grad

    def value(self, h, w, labels):
        """h (T, H); w (V, H); labels (T,) int32, -100 ignored → the summed loss (fp32 scalar)."""
        total = ops.zeros((), ms.float32)
        for start in range(0, h.shape[0], self.rows):  # unrolled: T is static; slices clip at T
            logits = _MATMUL_NT(h[start:start + self.rows], w).astype(ms.float32)  # (r, V)
            total = total - ops.reduce_sum(_label_log_probs(logits, labels[start:start + self.rows]))
        return total


def _block(hc, w, labels, dout):
    """One block: hc (r, H), labels (r,), dout (scalar or (r, 1)) → dh (r, H) fp32, c·p (r, V),
    the safe labels (r, 1), c (r, 1), and the labels' log-probs (r, 1), 0 where ignored (one
    logits matmul for all of them). dh is the gradient of −Σ dout·log p(label)."""
    lab = labels.reshape(-1, 1)
    keep = (lab != IGNORE_INDEX).astype(ms.int32)
    safe = lab * keep  # ignored rows point at row 0 with a zero coefficient
    coef = keep.astype(ms.float32) * dout  # (r, 1)
    log_probs = ops.log_softmax(_MATMUL_NT(hc, w).astype(ms.float32), -1)  # (r, V)
    label_log_probs = ops.gather_elements(log_probs, 1, safe) * keep.astype(ms.float32)
    probs = ops.exp(log_probs) * coef  # (r, V)
    rows_w = ops.gather(w, safe.reshape(-1), 0).astype(ms.float32)  # (r, H): W[label]
    dh = _MATMUL_NN(probs.astype(w.dtype), w).astype(ms.float32) - coef * rows_w
    return dh, probs, safe, coef, label_log_probs


class ChunkedCrossEntropy(_LogitBlocks):
    """The chunked cross-entropy (``_LogitBlocks``) with its own backward: the forward keeps
    nothing for it but its inputs, and the backward recomputes each block's softmax."""

    def construct(self, h, w, labels):
        return self.value(h, w, labels)

    def bprop(self, h, w, labels, out, dout):
        # dW always: when the head is frozen nothing consumes it and the graph drops it. (The
        # loop is written out: MindSpore 2.10 fails to compile a bprop that calls a loop.)
        dh, dw = (), ops.zeros(w.shape, ms.float32)
        for start in range(0, h.shape[0], self.rows):
            hc = h[start:start + self.rows]  # (r, H)
            dh_c, probs, safe, coef, _ = _block(hc, w, labels[start:start + self.rows], dout)
            dh = dh + (dh_c.astype(h.dtype),)
            dw = dw + _MATMUL_TN(probs.astype(hc.dtype), hc).astype(ms.float32)
            dw = ops.tensor_scatter_add(dw, safe, -coef * hc.astype(ms.float32))
        return ops.cat(dh, 0), dw.astype(w.dtype), labels * 0


class ChunkedCrossEntropyInForward(_LogitBlocks):
    """The chunked cross-entropy (``_LogitBlocks``) whose training forward forms the gradients
    (dout 1) and returns loss + Σ (h − stop_gradient(h))·dh (+ the same for W): the value is the
    loss to the last bit (each added term is exactly 0) and its gradient is dout·(dh, dW).

    For models with frozen weights: MindSpore 2.10 fails to differentiate a graph that holds a
    Cell ``bprop`` beside a layer compiled once (``no_inline``) that stops a frozen weight's
    gradient ("func graph is empty: zeros_like"). With a frozen head only dh (T, H) waits for the
    backward; a trained head's dW (V, H) would wait too (+2 GB at the Qwen2.5-0.5B shape), so
    full fine-tunes keep ``ChunkedCrossEntropy``. Outside training the forward is the loss alone.
    """

    def construct(self, h, w, labels):
        if not self.training:
            return self.value(h, w, labels)
        hs, ws = ops.stop_gradient(h), ops.stop_gradient(w)
        total, dh, dw = ops.zeros((), ms.float32), (), ops.zeros(w.shape, ms.float32)
        for start in range(0, h.shape[0], self.rows):  # ChunkedCrossEntropy.bprop's with dout 1
            hc = hs[start:start + self.rows]  # (r, H)
            dh_c, probs, safe, coef, log_probs = _block(hc, ws, labels[start:start + self.rows],
                                                        ops.ones((), ms.float32))
            total, dh = total - ops.reduce_sum(log_probs), dh + (dh_c,)
            if self.weight_grad:
                dw = dw + _MATMUL_TN(probs.astype(hc.dtype), hc).astype(ms.float32)
                dw = ops.tensor_scatter_add(dw, safe, -coef * hc.astype(ms.float32))
        dh = ops.cat(dh, 0)
        total = total + ops.reduce_sum((h - hs).astype(ms.float32) * dh.astype(ms.float32))
        if self.weight_grad:
            total = total + ops.reduce_sum((w - ws).astype(ms.float32) * dw.astype(ms.float32))
        return total


class _TokenLogProbs(_LogitBlocks):
    """Each labelled token's log-probability (T,) fp32 (0 where ignored), from the logits h·Wᵀ
    taken ``rows`` rows at a time: the log-probs of sequences, for preference losses."""

    def token_values(self, h, w, labels):
        """h (T, H); w (V, H); labels (T,) → log p(label) (T,) fp32, 0 where ignored."""
        pieces = ()
        for start in range(0, h.shape[0], self.rows):  # unrolled: T is static; slices clip at T
            logits = _MATMUL_NT(h[start:start + self.rows], w).astype(ms.float32)  # (r, V)
            pieces = pieces + (_label_log_probs(logits, labels[start:start + self.rows]).reshape(-1),)
        return ops.cat(pieces, 0)


class TokenLogProbs(_TokenLogProbs):
    """``_TokenLogProbs`` with its own backward: for a per-token dout (T,) it forms the gradients
    of Σ dout·log p block by block, recomputing each block's softmax (``_LogitBlocks``, with
    c = −dout)."""

    def construct(self, h, w, labels):
        return self.token_values(h, w, labels)

    def bprop(self, h, w, labels, out, dout):
        # written out as ChunkedCrossEntropy.bprop's (a bprop cannot call a loop in MindSpore 2.10)
        dh, dw = (), ops.zeros(w.shape, ms.float32)
        for start in range(0, h.shape[0], self.rows):
            hc = h[start:start + self.rows]  # (r, H)
            dh_c, probs, safe, coef, _ = _block(hc, w, labels[start:start + self.rows],
                                                -dout[start:start + self.rows].reshape(-1, 1))
            dh = dh + (dh_c.astype(h.dtype),)
            dw = dw + _MATMUL_TN(probs.astype(hc.dtype), hc).astype(ms.float32)
            dw = ops.tensor_scatter_add(dw, safe, -coef * hc.astype(ms.float32))
        return ops.cat(dh, 0), dw.astype(w.dtype), labels * 0


class TokenLogProbsInForward(_TokenLogProbs):
    """``_TokenLogProbs`` whose training forward forms each token's gradient g_t = ∂log p_t/∂h_t
    (T, H) and returns log p + Σ_k (h − stop_gradient(h))·g: the value to the last bit, the
    gradient w.r.t. h exact for any function of the log-probs. For models with frozen weights
    (see ``ChunkedCrossEntropyInForward``); the head must be frozen (no dW is formed)."""

    def construct(self, h, w, labels):
        if not self.training:
            return self.token_values(h, w, labels)
        hs, ws = ops.stop_gradient(h), ops.stop_gradient(w)
        values, grads = (), ()
        for start in range(0, h.shape[0], self.rows):
            dh_c, _, _, _, log_probs = _block(hs[start:start + self.rows], ws, labels[start:start + self.rows],
                                              -ops.ones((), ms.float32))
            values, grads = values + (log_probs.reshape(-1),), grads + (dh_c,)
        return ops.cat(values, 0) + ops.reduce_sum((h - hs).astype(ms.float32) * ops.cat(grads, 0), -1)


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

    def cached(self, input_ids, position_ids, attention_mask, cache_position, k_cache, v_cache):
        """KV-cache step (see ``QwenModel.cached``): next-token logits (B, V) fp32 at the last
        of the T positions, and the updated caches (L, B, KV, MAX, D)."""
        h, k_cache, v_cache = self.model.cached(input_ids, position_ids, attention_mask,
                                                cache_position, k_cache, v_cache)
        return self.last_logits(h), k_cache, v_cache

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
        return -ops.reduce_sum(_label_log_probs(shift_logits, shift_labels)) / count

    def token_log_probs(self, input_ids, labels, differentiable: bool = True):
        """Each labelled next token's log-probability: input_ids, labels (R, S) → (R, S−1) fp32,
        at t the log p of labels[:, t+1] (HF shift), 0 where it is -100. Taken block by block
        (``TokenLogProbs``) as the loss is, so the (R, S, V) logits are never whole;
        ``differentiable=False`` forms no gradient (a reference model's pass)."""
        h, _, _ = self.model.run(input_ids, None)
        shift_labels = labels[:, 1:].reshape(-1).astype(ms.int32)  # (T,)
        if self.chunked_loss.rows and self.chunk_head and self.token_logps is not None:
            h2, w = self._head_operands(h)
            values = (self.token_logps(h2, w, shift_labels) if differentiable
                      else self.token_logps.token_values(h2, w, shift_labels))
        else:
            logits = self.logits(h[:, :-1]).reshape(-1, self.vocab_size).astype(ms.float32)  # (T, V)
            values = _label_log_probs(logits, shift_labels).reshape(-1)
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
            values, greedy = (), ()
            for start in range(0, h2.shape[0], self.chunked_loss.rows):  # unrolled: R·S is static
                v, g = _label_scores(_MATMUL_NT(h2[start:start + self.chunked_loss.rows], w).astype(ms.float32),
                                     flat[start:start + self.chunked_loss.rows])
                values, greedy = values + (v,), greedy + (g,)
            values, greedy = ops.cat(values, 0), ops.cat(greedy, 0)
        else:
            values, greedy = _label_scores(self.logits(h).reshape(-1, self.vocab_size).astype(ms.float32), flat)
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
