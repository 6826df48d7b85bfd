"""Mixture of experts (Qwen2-MoE, Qwen3-MoE): the router, the routed SwiGLU experts stacked as
[E, out, in] tensors, the sparse block that mixes them (with an optional gated shared expert),
and the routing statistics training reads: expert capacity, the dropped share and HF's
load-balancing loss."""
from __future__ import annotations

import math

import mindspore as ms
from mindspore import Parameter, nn, ops
from mindspore.common.initializer import initializer

from mindqwen.config import ExecutionOptions, QwenConfig
from mindqwen.models.graph import low_dtype
from mindqwen.models.init import INIT_STD, RandomNormal
from mindqwen.models.layers import MLP, Linear


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
