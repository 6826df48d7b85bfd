"""The optimizer update alone: ms per step of mindqwen's AdamW against torch.optim.AdamW on the
same parameter set, with the earlier ``nn.AdamWeightDecay`` (no bias correction) beside it.

The parameters are the trainable tensors of a full fine-tune of ``--shape`` (the weights of
``QwenConfig.tensor_shapes``: bench-small by default, or a preset such as qwen2.5-0.5b), filled
with seeded normals; each step feeds the same seeded gradients. One JSON line per optimizer:
``ms_per_step`` (median after ``--warmup`` steps), ``parameters``.

    python benchmarks/optimizer.py [--shape bench-small|qwen2.5-0.5b] [--steps 20]
    /path/to/torch-venv/bin/python benchmarks/peers/torch_adamw.py [--shape ...]   # the peer

Run both in one sitting, alternated: the ratio is the figure.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_SMALL = dict(vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)


def shapes(name: str) -> dict:
    """HF name → shape of every weight of the model ``name`` (needs no torch)."""
    from mindqwen.config import QwenConfig
    config = QwenConfig(**BENCH_SMALL) if name == "bench-small" else QwenConfig.from_preset(name)
    return config.tensor_shapes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="bench-small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    import mindqwen  # noqa: F401  first: process settings
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, Tensor, nn
    from mindqwen.train.optim import AdamW, WarmupSchedule, param_groups
    ms.set_context(mode=ms.GRAPH_MODE)
    named = shapes(args.shape)
    rng = np.random.default_rng(0)
    grads = tuple(Tensor(rng.standard_normal(s, dtype=np.float32)) for s in named.values())

    class Update(nn.Cell):
        def __init__(self, optimizer):
            super().__init__()
            self.optimizer = optimizer

        def construct(self, grads):
            return self.optimizer(grads)

    for kind in ("AdamW", "nn.AdamWeightDecay"):
        params = [Parameter(Tensor(rng.standard_normal(s, dtype=np.float32)), name=n) for n, s in named.items()]
        groups = param_groups(params, 0.01)
        optimizer = (AdamW(groups, WarmupSchedule("constant", 1e-4, 10 ** 6)) if kind == "AdamW" else
                     nn.AdamWeightDecay(groups, learning_rate=1e-4))
        order = {p.name: i for i, p in enumerate(params)}
        step_grads = tuple(grads[order[p.name]] for p in optimizer.parameters)
        update = Update(optimizer)
        times = []
        for _ in range(args.warmup + args.steps):
            t = time.perf_counter()
            update(step_grads)
            params[0].asnumpy()  # wait for the update
            times.append(time.perf_counter() - t)
        print(json.dumps({"stack": "mindqwen", "optimizer": kind, "shape": args.shape,
                          "parameters": int(sum(np.prod(s) for s in named.values())),
                          "first_step_s": round(times[0], 3),
                          "ms_per_step": round(1e3 * statistics.median(times[args.warmup:]), 2)}))


if __name__ == "__main__":
    main()
