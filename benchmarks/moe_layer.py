"""One mixture-of-experts layer, forward and backward in graph mode: exact (every expert on every
token) against ``moe_capacity_factor`` (each expert on its C = ceil(f·N·k/E) heaviest tokens).
One JSON line per variant, measured in one process.

    python benchmarks/moe_layer.py [--shape bench-small-moe|e64k8] [--tokens 1024] [--steps 6]

``bench-small-moe``: hidden 512, 8 experts of width 352, top-2 (benchmarks/train.py's shape);
``e64k8``: hidden 512, 64 experts of width 192, top-8 (Qwen3-30B-A3B's E/k = 16 at a CPU size).
Random init (seed 0), fp32, loss = Σ y·r for a fixed random r. ``loss`` equal across variants
means nothing was dropped; ``dropped`` is the share of assignments beyond capacity.

``--stacked`` measures, instead, a prototype of the same capacity computation on
stacked expert weights (gate/up (E, H, 2I), down (E, I, H)): one gather of (E, C, H) tokens and
two batched matmuls instead of E gathers and 3·E matmuls. That is the layout Ascend's grouped
matmul (differentiable only with one (E, K, N) weight) and expert parallel (sharding E) need;
the prototype measures what it would cost or save on CPU. Compare one variant per process
(``--factors 1.25`` against ``--factors 1.25 --stacked``): a second large graph compiled in the
same process measured up to 1.3× slower than it does alone.
"""
import argparse
import json
import resource
import statistics
import time

from mindqwen import QwenConfig, backend  # before MindSpore: mindqwen sets what MindSpore reads at load
from mindqwen.models.qwen import SparseMoeBlock, dropped_share, expert_capacity

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

SHAPES = {"bench-small-moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352),
          "e64k8": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=192)}


class LayerStep(nn.Cell):
    """Σ y·r and its gradients with respect to the block's weights, one graph."""

    def __init__(self, block: SparseMoeBlock):
        super().__init__(auto_prefix=False)
        self.block = block
        self.grad = ms.value_and_grad(self.loss, None, block.trainable_params())

    def loss(self, x, r):
        return (self.block(x)[0] * r).sum()

    def construct(self, x, r):
        return self.grad(x, r)


class StackedCapacityBlock(nn.Cell):
    """``block``'s routing and capacity computation over stacked copies of its expert weights."""

    def __init__(self, block: SparseMoeBlock):
        super().__init__(auto_prefix=False)
        self.block = block
        experts = block.experts
        self.gate_up = Parameter(Tensor(np.stack([np.concatenate(
            [e.gate_proj.weight.asnumpy().T, e.up_proj.weight.asnumpy().T], 1) for e in experts])), name="gate_up")
        self.down = Parameter(Tensor(np.stack([e.down_proj.weight.asnumpy().T for e in experts])), name="down")
        for p in experts.get_parameters():  # the stacked copies replace them
            p.requires_grad = False

    def construct(self, x):
        b = self.block
        x2 = x.reshape(-1, x.shape[-1])  # (N, H)
        _, weights = b.route(x2)  # (N, E)
        n, e = x2.shape[0], b.num_experts
        capacity = expert_capacity(n, b.top_k, e, b.capacity_factor)
        rows = ops.stop_gradient(ops.topk(weights.swapaxes(0, 1), capacity)[1])  # (E, C)
        xe = ops.gather(x2, rows.reshape(-1), 0).reshape(e, capacity, -1)  # (E, C, H)
        gate, up = ops.split(ops.bmm(xe, self.gate_up), self.down.shape[1], -1)  # 2 × (E, C, I)
        ye = ops.bmm(ops.silu(gate) * up, self.down)  # (E, C, H)
        ye = ye * ops.gather_elements(weights.swapaxes(0, 1), 1, rows).expand_dims(-1)
        return ops.unsorted_segment_sum(ye.reshape(e * capacity, -1), rows.reshape(-1), n).reshape(x.shape), None


def measure(shape: str, tokens: int, factor, steps: int, stacked: bool = False) -> dict:
    config = QwenConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, qkv_bias=False,
                        qk_norm=True, norm_topk_prob=True, moe_capacity_factor=factor, **SHAPES[shape])
    ms.set_seed(0)
    block = SparseMoeBlock(config)
    block.set_train(True)
    if stacked:
        block = StackedCapacityBlock(block)
        block.set_train(True)
    rng = np.random.default_rng(0)
    x, r = (Tensor(rng.normal(0, 1, (1, tokens, 512)).astype(np.float32)) for _ in range(2))
    step = LayerStep(block)
    start = time.perf_counter()
    loss = step(x, r)[0].asnumpy()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step(x, r)[0].asnumpy()
        times.append(time.perf_counter() - start)
    routed = block.block if stacked else block
    dropped = float(dropped_share((routed(x)[1],), config.num_experts_per_tok, factor).asnumpy()) if factor else 0.0
    return {"benchmark": "moe_layer", "shape": shape, "tokens": tokens, "moe_capacity_factor": factor,
            "experts": "stacked" if stacked else "per-expert cells",
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "ms_per_step": round(1e3 * statistics.median(times), 1), "compile_s": round(compile_s - statistics.median(times), 1),
            "loss": float(loss), "dropped": round(dropped, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="bench-small-moe", choices=SHAPES)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--factors", default="none,2,1.25,1", help="comma-separated; none = exact")
    ap.add_argument("--stacked", action="store_true", help="the stacked-weight prototype instead (capacity only)")
    args = ap.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    backend.use_cpu_fusion()  # as QwenForCausalLM does on CPU: the layer is measured as the model runs it
    for f in args.factors.split(","):
        factor = None if f == "none" else float(f)
        if args.stacked and factor is None:
            raise SystemExit("--stacked runs the capacity computation: give --factors without none")
        print(json.dumps(measure(args.shape, args.tokens, factor, args.steps, args.stacked)), flush=True)


if __name__ == "__main__":
    main()
