"""Gated DeltaNet, the linear attention of Qwen3.5 / Qwen3-Next, as MindSpore functions and Cells equal to
HF's torch reference (``transformers.models.qwen3_5.modeling_qwen3_5``), with HF's parameter names.

Per value head, a state S (dk × dv) replaces the KV cache. At token t, with the l2-normalised key k_t and
query q_t (scaled by 1/√dk), the decay exp(g_t) ∈ (0, 1) and the write strength β_t ∈ (0, 1):

    S_t = exp(g_t) · S_{t-1} + k_t · (β_t · (v_t − exp(g_t) · S_{t-1}ᵀ k_t))ᵀ     (delta rule, gated)
    o_t = S_tᵀ q_t

``recurrent_gated_delta_rule`` runs it token by token (decoding); ``chunk_gated_delta_rule`` runs it a
chunk of C = 64 tokens at a time with matmuls (training, prefill): within a chunk the C writes are solved at
once through the UT transform, (I + A)⁻¹ with A strictly lower triangular, and only the state crosses
chunk boundaries. ``GatedDeltaNet`` is the layer (``linear_attn``): projections, the causal depthwise
convolution with SiLU, the rule, the gated RMSNorm, the output projection.

Everything here is tensor math on static shapes, for GRAPH_MODE: a Python ``if`` or ``for`` only ever
reads a shape or an argument that is None, so it is decided when the graph is compiled. The rule runs in
fp32 whatever the input dtype; states are fp32 and of fixed size.

Shapes: B batch, T tokens, Hk key heads, Hv value heads (a multiple of Hk: value head h reads key head
h // (Hv / Hk), HF's ``repeat_interleave``), dk / dv head dims, K the convolution kernel, conv_dim = 2·Hk·dk
+ Hv·dv the convolved channels (q, k, v side by side).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Uniform, initializer

from mindqwen.config import ConfigError, ExecutionOptions
from mindqwen.models.layers import Linear, exp_rounded, joined_weights, split_weights

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6  # HF's l2norm, as the FLA kernels
SOFTPLUS_THRESHOLD = 20.0  # torch's F.softplus: x itself above it
# HF draws A = exp(A_log) from U(0.01, 16) and sets dt_bias to ones; checkpoints overwrite both. Drawn by
# numpy's global generator, as the repository's initializers are (mindspore.set_seed fixes it).
A_INIT_RANGE = (0.01, 16.0)


def l2norm(x, eps: float = L2NORM_EPS):
    """x · rsqrt(Σ x² + eps) over the last axis (HF's ``l2norm``)."""
    return x * ops.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def _heads_first(q, k, v, g, beta):
    """q, k (B, T, Hk, dk), v (B, T, Hv, dv), g, beta (B, T, Hv) → fp32, heads first:
    q, k (B, Hv, T, dk) l2-normalised, q scaled by 1/√dk; v (B, Hv, T, dv); g, beta (B, Hv, T)."""
    b, t, hk, dk = k.shape
    hv = v.shape[2]
    rep = hv // hk
    if rep > 1:  # key head j serves value heads j·rep … j·rep + rep - 1 (repeat_interleave)
        q = ops.broadcast_to(q.expand_dims(3), (b, t, hk, rep, dk)).reshape(b, t, hv, dk)
        k = ops.broadcast_to(k.expand_dims(3), (b, t, hk, rep, dk)).reshape(b, t, hv, dk)
    q = l2norm(q.astype(ms.float32).transpose(0, 2, 1, 3)) * (dk ** -0.5)  # (B, Hv, T, dk)
    k = l2norm(k.astype(ms.float32).transpose(0, 2, 1, 3))
    v = v.astype(ms.float32).transpose(0, 2, 1, 3)  # (B, Hv, T, dv)
    return q, k, v, g.astype(ms.float32).transpose(0, 2, 1), beta.astype(ms.float32).transpose(0, 2, 1)


def chunk(x, i: int, gather: bool):
    """x[:, :, i]. ``gather``: as a Gather, for graphs without a backward: the CPU's StridedSlice takes ~3 ms
    for each chunk of the chunked rule at 0.8B widths, a Gather ~0.15 ms; but a Gather's backward scatters
    into a whole zero tensor per chunk, slower in training than the slice's. (Unstack is as fast both ways,
    and its backward fails to build in MindSpore 2.10 inside the layers compiled once.)"""
    return ops.gather(x, Tensor(i, ms.int32), 2) if gather else x[:, :, i]


def unit_lower_inverse(a):
    """(I + A)⁻¹ for A (..., C, C) strictly lower triangular, C a power of two: the exact inverse by
    recursive doubling of its diagonal blocks, with matmuls only (MindSpore has no triangular solve on CPU).

        ┌ I + A₁₁    0    ┐⁻¹   ┌  T₁₁          0  ┐
        └   A₂₁   I + A₂₂ ┘   = └ −T₂₂·A₂₁·T₁₁  T₂₂ ┘          blocks of s → 2s, s = 1, 2, …, C/2

    Level s as two full C × C matmuls: with D the block-diagonal inverse so far (blocks of s) and M_s the
    mask of the A₂₁ blocks (block row 2i+1, block column 2i, in blocks of s), D ← D − D·(A ⊙ M_s)·D.
    log₂ C − 1 levels of two matmuls after the first (D = I − A ⊙ M₁): as many matmuls as the Neumann
    product (I − A)(I + A²)(I + A⁴)…, and it computes what forward substitution computes. The Neumann
    product is unstable: A's powers grow like binomial coefficients when keys are alike (β near 1, g near 0),
    and it was off by 6e18 (relative) on the golden's ``hard`` case, where this is off by 6e-7. Measured
    for 64 matrices of 64 × 64 on 2 CPU cores, graph mode: 9-17 ms, against 4-7 ms for the Neumann product,
    23-41 ms for the same doubling on gathered s × s blocks, 85 ms for row-by-row substitution.
    """
    c = a.shape[-1]
    index = ops.arange(0, c, dtype=ms.int32)
    inv = ops.eye(c, c, a.dtype)
    s = 1
    while s < c:  # unrolled (s and c are constants); ms.export's graphs have no int.bit_length
        rows, cols = (index // s).reshape(c, 1), (index // s).reshape(1, c)  # block of s of each row, column
        below = ops.logical_and(rows == cols + 1, (cols % 2) == 0).astype(a.dtype)  # M_s (C, C)
        if s == 1:
            inv = inv - a * below  # D = I: D − D·(A ⊙ M₁)·D
        else:
            inv = inv - ops.matmul(inv, ops.matmul(a * below, inv))
        s = 2 * s
    return inv


def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK_SIZE,
                           float64: bool = True, output_final_state: bool = True, training: bool = True):
    """The gated delta rule a chunk at a time (HF's ``torch_chunk_gated_delta_rule`` with
    ``use_qk_l2norm_in_kernel=True``), for training and prefill.

    q, k (B, T, Hk, dk); v (B, T, Hv, dv); g (B, T, Hv) log-decays (≤ 0); beta (B, T, Hv);
    initial_state (B, Hv, dk, dv) or None (zeros); chunk_size a power of two; training: the graph has a
    backward (how the chunks are taken apart: ``chunk``).
    Returns out (B, T, Hv, dv) in q's dtype and the final state (B, Hv, dk, dv) fp32 (out alone without
    ``output_final_state``).

    T is padded to N chunks of C (pads have k = v = β = 0, g = 0: they change nothing). Within chunk n,
    with Γ the cumulative log-decay and D_ij = exp(Γ_i − Γ_j) = exp(Σ_{j<s≤i} g_s) for i ≥ j (0 above):

        A  = strictly_lower((β·K)·Kᵀ ⊙ D)            T = (I + A)⁻¹      (UT transform)
        U  = T·(β·V)                                  W = T·(β·exp(Γ)·K)
        V' = U − W·S                                  the part of the writes the state does not predict
        O  = (exp(Γ)·Q)·S + ((Q·Kᵀ) ⊙ D)·V'
        S ← exp(Γ_C)·S + (exp(Γ_C − Γ)·K)ᵀ·V'

    Everything but the last three lines is computed for all chunks at once; the loop over the N chunks
    is unrolled (N is static per shape).
    """
    dtype = q.dtype
    b, t = q.shape[:2]
    hv, dv = v.shape[2:]
    dk = k.shape[-1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # (B, Hv, T, ·)
    pad = (chunk_size - t % chunk_size) % chunk_size
    if pad:
        q = ops.cat((q, ops.zeros((b, hv, pad, dk), ms.float32)), 2)
        k = ops.cat((k, ops.zeros((b, hv, pad, dk), ms.float32)), 2)
        v = ops.cat((v, ops.zeros((b, hv, pad, dv), ms.float32)), 2)
        g = ops.cat((g, ops.zeros((b, hv, pad), ms.float32)), 2)
        beta = ops.cat((beta, ops.zeros((b, hv, pad), ms.float32)), 2)
    n = (t + pad) // chunk_size
    q = q.reshape(b, hv, n, chunk_size, dk)  # (B, Hv, N, C, dk)
    k = k.reshape(b, hv, n, chunk_size, dk)
    v = v.reshape(b, hv, n, chunk_size, dv)  # (B, Hv, N, C, dv)
    beta = beta.reshape(b, hv, n, chunk_size, 1)  # (B, Hv, N, C, 1)
    g = g.reshape(b, hv, n, chunk_size)
    cum = ops.cumsum(g, -1)  # Γ (B, Hv, N, C)
    # D_ij = exp(Σ_{j<s≤i} g_s), each exponent summed over its own tokens (not Γ_i − Γ_j: near the end of a
    # chunk both are large and their difference keeps few digits, 1e-5 relative at |Γ| ~ 100 in fp32).
    strict_lower = ops.tril(ops.ones((chunk_size, chunk_size), ms.float32), -1)  # (C, C)
    segments = ops.cumsum(g.expand_dims(-1) * strict_lower, -2)  # [i, j] = Σ_{j<s≤i} g_s (B, Hv, N, C, C)
    lower = strict_lower + ops.eye(chunk_size, chunk_size, ms.float32)  # diagonal included: D_ii = 1
    decay = exp_rounded(segments, float64) * lower  # (B, Hv, N, C, C); the exponents above the diagonal are 0
    k_beta = k * beta
    strict = ops.matmul(k_beta, k.swapaxes(-1, -2)) * decay * strict_lower  # A (B, Hv, N, C, C)
    ut = unit_lower_inverse(strict)  # T (B, Hv, N, C, C)
    new_values = ops.matmul(ut, v * beta)  # U (B, Hv, N, C, dv)
    cum_decay = exp_rounded(cum, float64)  # exp(Γ) (B, Hv, N, C)
    k_cumdecay = ops.matmul(ut, k_beta * cum_decay.expand_dims(-1))  # W (B, Hv, N, C, dk)
    intra = ops.matmul(q, k.swapaxes(-1, -2)) * decay  # (Q·Kᵀ) ⊙ D (B, Hv, N, C, C)
    q_decayed = q * cum_decay.expand_dims(-1)  # exp(Γ)·Q
    k_decayed = k * decay[..., -1, :].expand_dims(-1)  # exp(Γ_C − Γ)·K, Γ_C − Γ_j summed as D's
    chunk_decay = cum_decay[..., -1].reshape(b, hv, n, 1, 1)  # exp(Γ_C) (B, Hv, N, 1, 1)

    state = ops.zeros((b, hv, dk, dv), ms.float32) if initial_state is None else initial_state.astype(ms.float32)
    outs, fast = (), not training
    for i in range(n):
        v_new = chunk(new_values, i, fast) - ops.matmul(chunk(k_cumdecay, i, fast), state)  # V' (B, Hv, C, dv)
        outs = outs + (ops.matmul(chunk(q_decayed, i, fast), state) + ops.matmul(chunk(intra, i, fast), v_new),)
        state = state * chunk(chunk_decay, i, fast) + ops.matmul(chunk(k_decayed, i, fast).swapaxes(-1, -2), v_new)
    out = ops.stack(outs, 2).reshape(b, hv, n * chunk_size, dv)  # (B, Hv, N·C, dv)
    if pad:  # (a slice that keeps everything still copies: 37 ms at 512 tokens)
        out = out[:, :, :t]
    out = out.transpose(0, 2, 1, 3).astype(dtype)  # (B, T, Hv, dv)
    return (out, state) if output_final_state else out


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, float64: bool = True):
    """The gated delta rule token by token (HF's ``torch_recurrent_gated_delta_rule`` with
    ``use_qk_l2norm_in_kernel=True``), for decoding. The loop over T is unrolled into the graph: meant for
    T = 1 (a graph of T = 150 took 64 s to compile on 2 CPU cores); longer inputs take the chunked form.

    Shapes and returns as ``chunk_gated_delta_rule``: out (B, T, Hv, dv) in q's dtype, the final state
    (B, Hv, dk, dv) fp32.
    """
    dtype = q.dtype
    b, t = q.shape[:2]
    hv, dv = v.shape[2:]
    dk = k.shape[-1]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)  # (B, Hv, T, ·)
    state = ops.zeros((b, hv, dk, dv), ms.float32) if initial_state is None else initial_state.astype(ms.float32)
    outs = ()
    for i in range(t):
        k_i = chunk(k, i, True).expand_dims(-1)  # (B, Hv, dk, 1)
        state = state * exp_rounded(chunk(g, i, True), float64).reshape(b, hv, 1, 1)
        kv_mem = (state * k_i).sum(-2)  # Sᵀk (B, Hv, dv)
        delta = (chunk(v, i, True) - kv_mem) * chunk(beta, i, True).expand_dims(-1)
        state = state + k_i * delta.expand_dims(-2)
        outs = outs + ((state * chunk(q, i, True).expand_dims(-1)).sum(-2),)  # Sᵀq (B, Hv, dv)
    return ops.stack(outs, 1).astype(dtype), state  # (B, T, Hv, dv)


def causal_conv1d(x, weight, conv_state=None, output_state: bool = True):
    """The causal depthwise convolution with SiLU over a whole sequence (HF's ``causal_conv1d_fn``; with a
    state, the cache path of ``causal_conv1d_forward``):

        y[t, c] = silu(Σ_j weight[c, 0, j] · x̃[t + j, c]),   x̃ = [history (K−1 steps); x]

    x (B, T, conv_dim), time-major as the projection makes it; weight (conv_dim, 1, K);
    conv_state (B, conv_dim, K−1), the inputs before x, or None (zeros: left zero padding).
    Returns y (B, T, conv_dim) in x's dtype (computed in weight's) and the new state (B, conv_dim, K−1) fp32:
    the last K−1 inputs (y alone without ``output_state``).
    """
    b, t, c = x.shape
    kernel = weight.shape[-1]
    w = weight.reshape(c, kernel)
    if conv_state is None:
        history = ops.zeros((b, kernel - 1, c), w.dtype)
    else:
        history = conv_state.astype(w.dtype).transpose(0, 2, 1)  # (B, K−1, conv_dim)
    padded = ops.cat((history, x.astype(w.dtype)), 1)  # x̃ (B, K−1+T, conv_dim)
    y = padded[:, 0:t] * w[:, 0]
    for j in range(1, kernel):
        y = y + padded[:, j:j + t] * w[:, j]
    y = ops.silu(y).astype(x.dtype)
    return (y, padded[:, t:].transpose(0, 2, 1).astype(ms.float32)) if output_state else y


def causal_conv1d_update(x, weight, conv_state):
    """One step of ``causal_conv1d`` (HF's ``causal_conv1d_update``): x (B, 1, conv_dim), weight
    (conv_dim, 1, K), conv_state (B, conv_dim, K−1) → y (B, 1, conv_dim) and the new state (fp32)."""
    c, kernel = weight.shape[0], weight.shape[-1]
    window = ops.cat((conv_state.astype(weight.dtype), x.astype(weight.dtype).swapaxes(1, 2)), -1)  # (B, conv_dim, K)
    y = (window * weight.reshape(1, c, kernel)).sum(-1)  # (B, conv_dim)
    return ops.silu(y).expand_dims(1).astype(x.dtype), window[:, :, 1:].astype(ms.float32)


class DepthwiseConv1d(nn.Cell):
    """The ``conv1d`` of a GatedDeltaNet: only its ``weight`` (conv_dim, 1, K), HF's ``nn.Conv1d`` layout
    (groups = conv_dim, no bias); the convolution is ``causal_conv1d`` / ``causal_conv1d_update``."""

    def __init__(self, channels: int, kernel_size: int, dtype=ms.float32):
        super().__init__()
        # torch's Conv1d default: U(±1/√fan_in), fan_in = K for a depthwise kernel
        self.weight = Parameter(initializer(Uniform(kernel_size ** -0.5), (channels, 1, kernel_size), dtype),
                                name="weight")

    def weights(self) -> tuple:
        return (self.weight,)


class GatedRMSNorm(nn.Cell):
    """HF's ``Qwen3_5RMSNormGated``: weight · rmsnorm(x) · silu(z), the norm in fp32, cast back before the
    weight, the gate in fp32; returns x's dtype. x, z (..., D)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(initializer("ones", (dim,), dtype), name="weight")
        self.eps = eps

    def weights(self) -> tuple:
        return (self.weight,)

    def construct(self, x, z):
        return self.apply(self.weights(), x, z)

    def apply(self, w, x, z):
        x32 = x.astype(ms.float32)
        y = x32 * ops.rsqrt((x32 * x32).mean(-1, keep_dims=True) + self.eps)
        y = w[0] * y.astype(x.dtype)
        return (y * ops.silu(z.astype(ms.float32))).astype(x.dtype)


def _softplus(x):
    """torch's F.softplus (beta 1, threshold 20): log(1 + eˣ), x itself above the threshold. (The CPU's
    log1p is log(1 + y): in fp32 it loses all digits of a small y, so log-decays are formed in float64.)"""
    return ops.where(x > SOFTPLUS_THRESHOLD, x, ops.log1p(ops.exp(ops.minimum(x, SOFTPLUS_THRESHOLD))))


class GatedDeltaNet(nn.Cell):
    """The Gated DeltaNet layer of Qwen3.5 / Qwen3-Next (HF's ``Qwen3_5GatedDeltaNet``, ``linear_attn``):

        x (B, T, H) ─┬─ in_proj_qkv ─► conv1d + SiLU ─► q, k (B, T, Hk, dk), v (B, T, Hv, dv) ─┐
                     ├─ in_proj_b ─► β = sigmoid(b)                                            ├─► rule ─► o
                     ├─ in_proj_a ─► g = −exp(A_log) · softplus(a + dt_bias)   (fp32)  ────────┘
                     └─ in_proj_z ─► z (B, T, Hv, dv)
        o (B, T, Hv, dv) ─► norm(o, z) (per head) ─► out_proj ─► (B, T, H)

    ``construct`` is the whole-sequence form (training, prefill from empty states; the chunked rule);
    ``cached`` carries the conv state (B, conv_dim, K−1) and the recurrent state (B, Hv, dk, dv), both fp32:
    the chunked rule for T > 1, the recurrent one for T = 1. ``mask`` (B, T), 1 = token, 0 = padding, zeroes
    the padding's inputs first, as HF's ``apply_mask_to_padding_states``.

    The projections are the repository's ``Linear`` (LoRA targets them); ``weights()`` / ``apply(w, …)``
    follow ``Attention``: ``parts()``' weights then dt_bias and A_log, flat.
    """

    def __init__(self, hidden_size: int, linear_num_key_heads: int, linear_num_value_heads: int,
                 linear_key_head_dim: int, linear_value_head_dim: int, linear_conv_kernel_dim: int,
                 rms_norm_eps: float = 1e-6, dtype=ms.float32, chunk_size: int = CHUNK_SIZE, float64: bool = True):
        """float64: decays (exp, softplus) through float64 kernels, where the device has them (the CPU)."""
        super().__init__()
        self.device_float64 = self.float64 = float64
        if linear_num_value_heads % linear_num_key_heads:
            raise ConfigError(f"linear_num_value_heads {linear_num_value_heads} must be a multiple of "
                              f"linear_num_key_heads {linear_num_key_heads}")
        if chunk_size < 1 or chunk_size & (chunk_size - 1):
            raise ConfigError(f"chunk_size {chunk_size} must be a power of two (the UT inverse doubles blocks)")
        self.num_k_heads, self.num_v_heads = linear_num_key_heads, linear_num_value_heads
        self.head_k_dim, self.head_v_dim = linear_key_head_dim, linear_value_head_dim
        self.key_dim = linear_num_key_heads * linear_key_head_dim
        self.value_dim = linear_num_value_heads * linear_value_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = linear_conv_kernel_dim
        self.chunk_size = chunk_size
        self.in_proj_qkv = Linear(hidden_size, self.conv_dim, False, dtype)
        self.in_proj_z = Linear(hidden_size, self.value_dim, False, dtype)
        self.in_proj_b = Linear(hidden_size, linear_num_value_heads, False, dtype)
        self.in_proj_a = Linear(hidden_size, linear_num_value_heads, False, dtype)
        self.conv1d = DepthwiseConv1d(self.conv_dim, linear_conv_kernel_dim, dtype)
        self.dt_bias = Parameter(initializer("ones", (linear_num_value_heads,), dtype), name="dt_bias")
        a_init = np.log(np.random.uniform(*A_INIT_RANGE, linear_num_value_heads)).astype(np.float32)
        self.A_log = Parameter(Tensor(a_init).astype(dtype), name="A_log")
        self.norm = GatedRMSNorm(linear_value_head_dim, rms_norm_eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden_size, False, dtype)

    @classmethod
    def from_config(cls, config, dtype=ms.float32, float64: bool = True) -> "GatedDeltaNet":
        """The layer of a config with HF's Qwen3.5 field names (``linear_num_key_heads`` …)."""
        names = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps")
        missing = [name for name in names if getattr(config, name, None) is None]
        if missing:
            raise ConfigError(f"a Gated DeltaNet layer needs {', '.join(missing)} in the config "
                              f"({type(config).__name__} has none)")
        return cls(*(getattr(config, name) for name in names), dtype=dtype, float64=float64)

    def apply_options(self, options: ExecutionOptions) -> None:
        self.float64 = self.device_float64 and options.float64

    def parts(self) -> tuple:
        return self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.conv1d, self.norm, self.out_proj

    def weights(self) -> tuple:
        """The parts' weights, then dt_bias and A_log, flat."""
        return joined_weights(self.parts()) + (self.dt_bias, self.A_log)

    def construct(self, x, mask=None):
        """x (B, T, H), mask (B, T) or None → (B, T, H), from empty states."""
        return self.apply(self.weights(), x, mask)

    def cached(self, x, conv_state, recurrent_state, mask=None):
        """x (B, T, H) after the tokens that left conv_state (B, conv_dim, K−1) and recurrent_state
        (B, Hv, dk, dv) → out (B, T, H), the new conv state and recurrent state (fp32, same shapes)."""
        return self.apply_cached(self.weights(), x, conv_state, recurrent_state, mask)

    def apply(self, w, x, mask=None):
        """``construct`` with ``weights()`` w."""
        return self._run(w, x, None, None, mask, False)

    def apply_cached(self, w, x, conv_state, recurrent_state, mask=None):
        """``cached`` with ``weights()`` w."""
        return self._run(w, x, conv_state, recurrent_state, mask, True)

    def _run(self, w, x, conv_state, recurrent_state, mask, with_states: bool):
        """The layer; with_states: also return the new states (a training pass forms none: the backward of
        two layers' unused state outputs fails to build in MindSpore 2.10's graph mode)."""
        dt_bias, a_log = w[-2], w[-1]
        w = split_weights(w, self.parts())
        if mask is not None:
            x = x * mask.expand_dims(-1).astype(x.dtype)
        b, t, _ = x.shape
        mixed = self.in_proj_qkv.apply(w[0], x)  # (B, T, conv_dim)
        z = self.in_proj_z.apply(w[1], x).reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = ops.sigmoid(self.in_proj_b.apply(w[2], x))  # (B, T, Hv)
        a = self.in_proj_a.apply(w[3], x).astype(ms.float32) + dt_bias.astype(ms.float32)
        if self.float64:
            a, a_log = a.astype(ms.float64), a_log.astype(ms.float64)
        g = (-ops.exp(a_log.astype(a.dtype)) * _softplus(a)).astype(ms.float32)  # (B, T, Hv)
        decode = conv_state is not None and t == 1
        if decode:
            mixed, conv_state = causal_conv1d_update(mixed, w[4][0], conv_state)
        elif with_states:
            mixed, conv_state = causal_conv1d(mixed, w[4][0], conv_state)
        else:
            mixed = causal_conv1d(mixed, w[4][0], output_state=False)
        q = mixed[..., :self.key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = mixed[..., self.key_dim:2 * self.key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = mixed[..., 2 * self.key_dim:].reshape(b, t, self.num_v_heads, self.head_v_dim)
        if decode:
            o, recurrent_state = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state, self.float64)
        elif with_states:
            o, recurrent_state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, self.chunk_size,
                                                        self.float64, training=self.training)
        else:
            o = chunk_gated_delta_rule(q, k, v, g, beta, None, self.chunk_size, self.float64, output_final_state=False,
                                       training=self.training)
        o = self.norm.apply(w[5], o, z.astype(o.dtype))  # (B, T, Hv, dv)
        out = self.out_proj.apply(w[6], o.reshape(b, t, self.value_dim))
        if not with_states:
            return out
        return out, conv_state, recurrent_state
