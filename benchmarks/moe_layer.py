"""One mixture-of-experts layer, forward and backward in graph mode: exact (every expert on every
token) against ``moe_capacity_factor`` (each expert on its C = ceil(f·N·k/E) heaviest tokens).
One JSON line per variant, measured in one process.

    python benchmarks/moe_layer.py [--shape bench-small-moe|e64k8] [--tokens 1024] [--steps 6]

``bench-small-moe``: hidden 512, 8 experts of width 352, top-2 (benchmarks/train.py's shape);
``e64k8``: hidden 512, 64 experts of width 192, top-8 (Qwen3-30B-A3B's E/k = 16 at a CPU size).
Random init (seed 0), fp32, loss = Σ y·r for a fixed random r. ``loss`` equal across variants
means nothing was dropped; ``dropped`` is the share of assignments beyond capacity.
"""
import argparse
import json
import statistics
import time

from mindqwen import QwenConfig  # before MindSpore: mindqwen sets what MindSpore reads at load
from mindqwen.models.qwen import SparseMoeBlock, dropped_share

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

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


def measure(shape: str, tokens: int, factor, steps: int) -> dict:
    config = QwenConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, qkv_bias=False,
                        qk_norm=True, norm_topk_prob=True, moe_capacity_factor=factor, **SHAPES[shape])
    ms.set_seed(0)
    block = SparseMoeBlock(config)
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
    dropped = float(dropped_share((block(x)[1],), config.num_experts_per_tok, factor).asnumpy()) if factor else 0.0
    return {"benchmark": "moe_layer", "shape": shape, "tokens": tokens, "moe_capacity_factor": factor,
            "ms_per_step": round(1e3 * statistics.median(times), 1), "compile_s": round(compile_s - statistics.median(times), 1),
            "loss": float(loss), "dropped": round(dropped, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="bench-small-moe", choices=SHAPES)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--factors", default="none,2,1.25,1", help="comma-separated; none = exact")
    args = ap.parse_args()
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    for f in args.factors.split(","):
        print(json.dumps(measure(args.shape, args.tokens, None if f == "none" else float(f), args.steps)), flush=True)


if __name__ == "__main__":
    main()
