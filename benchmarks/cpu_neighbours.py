"""A graph-mode train step beside another busy process, pinned to a core or not (CPU).

MindSpore's runtime hands each kernel from an actor thread to a kernel thread, and the two
spin-wait for each other: one process with one op thread keeps ~1.8 cores busy, and beside a
busy neighbour its step slows down far more than one core's worth. Pinning the process to one
core (as tests/conftest.py does for each xdist worker, and ``msrun --bind_core=True`` for data
parallel workers) takes the handoff off the other core. One JSON line per setting:

    python benchmarks/cpu_neighbours.py [--steps 100]

Each setting runs in a fresh process: the demo's shape (4 layers × 128, vocab 160), full
fine-tune, batch 32 × 32, fp32, one op thread; ``neighbour`` is a ``while True: pass`` process
(on the other core when pinned). ``cpu_percent`` is the step loop's process CPU time / wall time.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

SETTINGS = {"alone": (False, False), "neighbour": (False, True), "pinned, neighbour": (True, True)}


def measure(steps: int) -> dict:
    from mindqwen import QwenConfig, QwenForCausalLM  # before MindSpore: mindqwen sets what it reads at load
    import mindspore as ms
    import numpy as np
    from mindqwen.train.optim import WarmupSchedule, make_optimizer
    from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
    from mindqwen.train.step import Stepper
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.device_context.cpu.op_tuning.threads_num(1)
    ms.set_seed(0)
    model = QwenForCausalLM(QwenConfig(vocab_size=160, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       qkv_bias=True, tie_word_embeddings=True))
    optimizer = make_optimizer(model.trainable_params(), WarmupSchedule("constant", 1e-3, 100))
    stepper = Stepper(model, optimizer, make_loss_scaler(PrecisionConfig()), 1, 1.0, False)
    ids = ms.Tensor(np.random.default_rng(0).integers(0, 160, (32, 32)).astype(np.int32))
    stepper([(ids, ids)])  # compile
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        stepper([(ids, ids)])
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"ms_per_step": round(1000 * wall / steps, 1), "cpu_percent": round(100 * cpu / wall)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps)))
        return
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores")
    core, other = sorted(os.sched_getaffinity(0))[:2]
    for name, (pinned, busy) in SETTINGS.items():
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                     preexec_fn=(lambda: os.sched_setaffinity(0, {other})) if pinned else None) \
            if busy else None
        try:
            run = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps)],
                                 capture_output=True, text=True, check=True, env={**os.environ, "GLOG_v": "3"},
                                 preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if pinned else None)
        finally:
            if neighbour is not None:
                neighbour.kill()
        print(json.dumps({"benchmark": "cpu_neighbours", "setting": name, "steps": args.steps,
                          **json.loads(run.stdout.strip().splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
