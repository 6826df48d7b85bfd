"""What a user waits for: the whole process to its first finished LoRA step, against depth.

For each depth, in one sitting and alternated with the peer (``--peer``: the python of a
virtualenv with torch, transformers and peft; ``../shared/bench/peer_hf_lora.py``), a fresh
process imports, builds a random model of the shape, takes one train step and exits; the parent
times it from spawn to the moment the process reports the step done (``wall_to_first_step_s``),
so imports, build, compile and the step all count, as they do for a user. mindqwen's process also
reports its parts (``import_s``, ``build_s``, ``compile_and_step_s``: the first call of the
compiled step) and then the first generated token after load (``first_token_s``: the prefill
graph's compile and one token, batch 1, 32-token prompt). One JSON line per process:

    python benchmarks/first_step.py [--shape qwen2.5-0.5b] [--depths 4,8,16,24] [--peer PYTHON]
                                    [--batch 1 --seq 512] [--no-generate] [--layouts auto,on,off]

``--layouts``: mindqwen's ``compile_once`` settings (``benchmarks/train.py --compile-once``:
auto, on, off), each its own process, in that order before the peer at each depth.

Shapes and data as ``benchmarks/train.py`` (fp32, LoRA r 8 / alpha 32 on q_proj, v_proj, AdamW).
The memory of this machine kind is slow to touch the first time after it was freed (~0.4 GB/s,
against ~8 GB/s once touched): builds and first steps include that, for both frameworks alike.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_SCRIPT = os.path.join(HERE, "..", "..", "shared", "bench", "peer_hf_lora.py")
DONE = "FIRST STEP DONE"


def child(args: argparse.Namespace) -> None:
    """The measured process: imports, build, one step, then (optionally) the first token."""
    t0 = time.perf_counter()
    sys.path.insert(0, HERE)
    from train import build  # imports mindqwen, then MindSpore; builds model, Stepper and data
    import mindspore as ms
    t_import = time.perf_counter()
    args.full, args.recompute, args.recompute_every, args.threads = False, "none", 1, 0
    args.targets, args.moe_capacity_factor, args.fusion, args.steps = "q_proj,v_proj", None, True, 1
    args.compile_once = args.layout
    model, config, stepper, data = build(args)
    t_built = time.perf_counter()
    ids = ms.Tensor(data[0])
    loss = stepper([(ids, ids)])[0]
    t_step = time.perf_counter()
    print(DONE, flush=True)
    out = {"framework": "mindqwen", "layout": args.layout, "layers": config.num_hidden_layers, "import_s": round(t_import - t0, 2),
           "build_s": round(args.build_s, 2), "model_and_data_s": round(t_built - t_import, 2),
           "compile_and_step_s": round(t_step - t_built, 2), "loss": round(float(loss), 4)}
    if args.generate:
        from mindqwen import generate
        model.set_train(False)
        prompt = ms.Tensor(data[0][:1, :32])
        t = time.perf_counter()
        generate(model, prompt, max_new_tokens=1)
        out["first_token_s"] = round(time.perf_counter() - t, 2)
    print(json.dumps(out), flush=True)


def timed(cmd: list, stream: str) -> tuple:
    """Run ``cmd``; seconds from spawn until a line of ``stream`` shows the first step done,
    and the last JSON line on stdout."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "GLOG_v": "3"})
    watched = p.stdout if stream == "stdout" else p.stderr
    first, lines = None, []
    for line in watched:
        lines.append(line)
        if first is None and (line.startswith(DONE) or line.startswith("step 0 ")):
            first = time.perf_counter() - start
    other = p.stderr.read() if stream == "stdout" else p.stdout.read()
    p.wait()
    stdout = "".join(lines) if stream == "stdout" else other
    if p.returncode or first is None:
        raise SystemExit(f"{cmd[1]} failed ({p.returncode}):\n{(other if stream == 'stdout' else ''.join(lines))[-2000:]}")
    return first, json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def peer_cmd(python: str, args: argparse.Namespace, layers: int) -> list:
    sys.path.insert(0, HERE)
    from train import shape_config
    c = shape_config(args.shape, layers)
    cmd = [python, PEER_SCRIPT, "--steps", "1", "--warmup", "0", "--batch", str(args.batch), "--seq", str(args.seq)]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps"):
        cmd += ["--" + key.replace("_", "-"), str(c[key])]
    return cmd + ([] if c.get("tie_word_embeddings", True) else ["--no-tie-word-embeddings"])


def main() -> None:
    sys.path.insert(0, HERE)
    from train import SHAPES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=SHAPES)
    ap.add_argument("--depths", default="4,8,16,24")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--peer", help="python of the peer's virtualenv (torch + transformers + peft)")
    ap.add_argument("--no-generate", dest="generate", action="store_false")
    ap.add_argument("--layouts", default="auto", help="compile_once settings: auto, on, off, comma-separated")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    for layers in (int(d) for d in args.depths.split(",")):
        mine = [sys.executable, __file__, "--child", "--shape", args.shape, "--layers", str(layers),
                "--batch", str(args.batch), "--seq", str(args.seq)] + ([] if args.generate else ["--no-generate"])
        runs = [("mindqwen", mine + ["--layout", layout], "stdout") for layout in args.layouts.split(",")]
        runs += [("peer", peer_cmd(args.peer, args, layers), "stderr")] if args.peer else []
        for name, cmd, stream in runs:
            wall, out = timed(cmd, stream)
            keep = out if name == "mindqwen" else {"framework": "HF + PEFT (torch %s)" % out["versions"]["torch"],
                                                     "step_s": round(out["step_ms"] / 1e3, 2)}
            print(json.dumps({"benchmark": "first_step", "shape": args.shape, "layers": layers, "batch": args.batch,
                              "seq": args.seq, "wall_to_first_step_s": round(wall, 1), **keep}), flush=True)


if __name__ == "__main__":
    main()
