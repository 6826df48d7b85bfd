"""The building blocks every decoder here is made of: Linear, Embedding, RMSNorm (plain and
zero-centred), the SwiGLU MLP, and the flat weight tuples the compile-once graphs pass around.

Each block with weights has ``weights()`` (its Parameters, flat) and ``apply(w, ...)`` (its math
with those weights passed in), so a decoder layer compiled once runs with any layer's weights
(``models/graph.py``); ``construct`` is ``apply(self.weights(), ...)``.
"""
from __future__ import annotations

from typing import Optional

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

from mindqwen.config import ExecutionOptions, QwenConfig
from mindqwen.models.graph import low_dtype
from mindqwen.models.init import INIT_STD, RandomNormal


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


def exp_rounded(x, float64: bool = True):
    """exp(x) in x's dtype, through float64 where the device has float64 kernels (``float64``): the
    CPU's fp32 exp is off by up to 3e-6 relative (~50 ulp) near 0 and by more as |x| grows (1e-5 at
    x = -30), while its float64 exp rounds to within an ulp of fp32."""
    return ops.exp(x.astype(ms.float64)).astype(x.dtype) if float64 else ops.exp(x)


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
    """weight · x / sqrt(mean(x²) + eps), computed in fp32 and cast back (as HF does).

    ``zero_centered`` (Qwen3.5): the weight is stored as an offset from 1, x̂ · (1 + w), starts
    at 0, and multiplies in fp32 before the cast.
    """

    def __init__(self, dim: int, eps: float, dtype=ms.float32, use_fused_ops: bool = False,
                 zero_centered: bool = False):
        super().__init__()
        self.weight = Parameter(initializer("zeros" if zero_centered else "ones", (dim,), dtype), name="weight")
        self.eps, self.use_fused_ops, self.zero_centered = eps, use_fused_ops, zero_centered

    def weights(self) -> tuple:
        return (self.weight,)

    def construct(self, x):
        return self.apply(self.weights(), x)

    def apply(self, w, x):
        weight = w[0]
        if self.use_fused_ops:
            return ops.rms_norm(x, 1 + weight if self.zero_centered else weight, self.eps)[0]
        x32 = x.astype(ms.float32)
        y = x32 * ops.rsqrt(ops.mean(x32 * x32, -1, keep_dims=True) + self.eps)
        if self.zero_centered:
            return (y * (1 + weight.astype(ms.float32))).astype(x.dtype)
        return weight * y.astype(x.dtype)


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
