"""A small fit() run for subprocess tests (resume after SIGKILL, msrun data parallel).

    python run_fit.py OUTPUT_DIR [--steps N] [--save-every K] [--resume auto] [--global-batch B]
                      [--kill-at-step S] [--dump PARAMS.npz] [--full] [--compile-cache DIR]
"""
import argparse
import os
import signal
import sys

import mindqwen  # noqa: F401  before MindSpore, as users should
import mindspore as ms
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import fixture_path  # noqa: E402
from mindqwen import LoraConfig, apply_lora, from_pretrained  # noqa: E402
from mindqwen.data.loader import TokenDataset  # noqa: E402
from mindqwen.train import loop  # noqa: E402
from mindqwen.train.config import TrainerConfig  # noqa: E402
from mindqwen.train.distributed import init_parallel  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("output_dir")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--kill-at-step", type=int, default=0)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    ap.add_argument("--compile-cache", default=None)
    args = ap.parse_args()
    if args.compile_cache:  # MindSpore cannot cache fused graphs (mindqwen/train/compile_cache.py)
        mindqwen.backend.disable_cpu_fusion()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)  # LoRA A is drawn before fit() seeds: fix it here
    rank, world = init_parallel()
    data = TokenDataset(np.random.default_rng(0).integers(0, 512, (64, 24)))
    model = from_pretrained(fixture_path("qwen2_tiny", "base"))
    if not args.full:
        apply_lora(model, LoraConfig(r=4, lora_alpha=8))
    config = TrainerConfig(max_steps=args.steps, micro_batch_size=args.global_batch // world, lr=5e-3,
                           warmup_steps=2, save_every=args.save_every, resume=args.resume,
                           output_dir=args.output_dir, progress=False, compile_cache=args.compile_cache)
    if args.kill_at_step:  # die like a killed job: right after logging that step, no clean-up
        write = loop.MetricsLog.write

        def write_then_die(self, record):
            write(self, record)
            if record["step"] == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
        loop.MetricsLog.write = write_then_die
    loop.fit(model, data, config)
    if args.dump:
        np.savez(args.dump.replace("RANK", str(rank)), **{p.name: p.asnumpy() for p in model.trainable_params()})


if __name__ == "__main__":
    main()
