"""One mixture-of-experts layer, forward and backward in graph mode: exact (every expert on every
token) against ``moe_capacity_factor`` (each expert on its C = ceil(f·N·k/E) heaviest tokens), with
the model's stacked experts against per-expert Cells (the layout before 2026-12-06, rebuilt here
from the same weights as the baseline). One JSON line per variant; every variant runs in its own
process (a second large graph compiled in one process measured up to 1.3× slower than alone),
``--rounds`` times, alternating, and the last line gives the per-expert / stacked ratios.

    python benchmarks/moe_layer.py [--shape bench-small-moe|e64k8] [--tokens 1024] [--steps 6]
                                   [--factors none,2,1.25,1] [--layouts stacked,per-expert] [--rounds 1]

``bench-small-moe``: hidden 512, 8 experts of width 352, top-2 (benchmarks/train.py's shape);
``e64k8``: hidden 512, 64 experts of width 192, top-8 (Qwen3-30B-A3B's E/k = 16 at a CPU size).
Random init (seed 0), fp32, loss = Σ y·r for a fixed random r. ``loss`` equal across variants
means nothing was dropped; ``dropped`` is the share of assignments beyond capacity.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

SHAPES = {"bench-small-moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352),
          "e64k8": dict(num_experts=64, num_experts_per_tok=8, moe_intermediate_size=192)}


def measure(shape: str, tokens: int, factor, steps: int, layout: str) -> dict:
    """One variant, in this process (MindSpore is imported here: the parent that runs the
    variants never loads it, so no idle runtime threads share the two cores)."""
    from mindqwen import QwenConfig, backend  # before MindSpore: mindqwen sets what MindSpore reads at load
    from mindqwen.models.moe import SparseMoeBlock, dropped_share, expert_capacity
    from mindqwen.models.layers import MLP

    import mindspore as ms
    from mindspore import Tensor, nn, ops

    class PerExpertBlock(nn.Cell):
        """``block``'s routing with one SwiGLU Cell per expert (copies of its stacked weights),
        computed as the model did before the experts were stacked: E matmuls per projection."""

        def __init__(self, block: SparseMoeBlock, config: QwenConfig):
            super().__init__(auto_prefix=False)
            self.block = block
            self.experts = nn.CellList([MLP(config, intermediate_size=config.moe_intermediate_size)
                                        for _ in range(config.num_experts)])
            for e, expert in enumerate(self.experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    getattr(expert, proj).weight.set_data(Tensor(getattr(block.experts, proj).weight.asnumpy()[e]))
            for p in block.experts.get_parameters():  # the copies replace them
                p.requires_grad = False

        def construct(self, x):
            b = self.block
            x2 = x.reshape(-1, x.shape[-1])  # (N, H)
            router_logits, weights = b.route(x2)  # (N, E)
            n = x2.shape[0]
            if b.capacity_factor is None:
                y = ops.zeros_like(x2)
                for e, expert in enumerate(self.experts):
                    y = y + expert(x2) * weights[:, e:e + 1]
            else:
                capacity = expert_capacity(n, b.top_k, b.num_experts, b.capacity_factor)
                rows = ops.stop_gradient(ops.topk(weights.swapaxes(0, 1), capacity)[1])  # (E, C)
                out = [expert(ops.gather(x2, rows[e], 0)) * ops.gather(weights[:, e], rows[e], 0).expand_dims(-1)
                       for e, expert in enumerate(self.experts)]
                y = ops.unsorted_segment_sum(ops.cat(out, 0), rows.reshape(-1), n)
            return y.reshape(x.shape), router_logits

    class LayerStep(nn.Cell):
        """Σ y·r and its gradients with respect to the block's weights, one graph."""

        def __init__(self, block):
            super().__init__(auto_prefix=False)
            self.block = block
            self.grad = ms.value_and_grad(self.loss, None, block.trainable_params())

        def loss(self, x, r):
            return (self.block(x)[0] * r).sum()

        def construct(self, x, r):
            return self.grad(x, r)

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    backend.use_cpu_fusion()  # as QwenForCausalLM does on CPU: the layer is measured as the model runs it
    config = QwenConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, qkv_bias=False,
                        qk_norm=True, norm_topk_prob=True, moe_capacity_factor=factor, **SHAPES[shape])
    ms.set_seed(0)
    block = routed = SparseMoeBlock(config)
    if layout == "per-expert":
        block = PerExpertBlock(routed, config)
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
    dropped = float(dropped_share((routed(x)[1],), config.num_experts_per_tok, factor).asnumpy()) if factor else 0.0
    return {"benchmark": "moe_layer", "shape": shape, "tokens": tokens, "moe_capacity_factor": factor,
            "experts": layout, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "ms_per_step": round(1e3 * statistics.median(times), 1), "compile_s": round(compile_s - statistics.median(times), 1),
            "loss": float(loss), "dropped": round(dropped, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="bench-small-moe", choices=SHAPES)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--factors", default="none,2,1.25,1", help="comma-separated; none = exact")
    ap.add_argument("--layouts", default="stacked,per-expert", help="comma-separated: stacked, per-expert")
    ap.add_argument("--rounds", type=int, default=1, help="alternating runs of every variant")
    ap.add_argument("--one", nargs=2, metavar=("LAYOUT", "FACTOR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        layout, f = args.one
        print(json.dumps(measure(args.shape, args.tokens, None if f == "none" else float(f), args.steps, layout)))
        return
    results = {}
    for _ in range(args.rounds):
        for f in args.factors.split(","):
            for layout in args.layouts.split(","):
                out = subprocess.run([sys.executable, __file__, "--shape", args.shape, "--tokens", str(args.tokens),
                                      "--steps", str(args.steps), "--one", layout, f],
                                     check=True, capture_output=True, text=True).stdout
                line = json.loads(out.strip().splitlines()[-1])
                print(json.dumps(line), flush=True)
                results.setdefault((f, layout), []).append(line["ms_per_step"])
    ratios = {f"f={f}": round(statistics.median(results[(f, "per-expert")]) / statistics.median(results[(f, "stacked")]), 2)
              for f in args.factors.split(",") if (f, "per-expert") in results and (f, "stacked") in results}
    print(json.dumps({"benchmark": "moe_layer", "shape": args.shape, "per_expert_over_stacked": ratios,
                      "ms_per_step_median": {f"{f} {layout}": statistics.median(v) for (f, layout), v in results.items()}}))


if __name__ == "__main__":
    main()
