"""mindqwen against the PyTorch + PEFT peer, side by side in one sitting: one JSON line of ratios.

For each workload, ``--rounds`` rounds run mindqwen's benchmark and the peer
(../shared/bench/peer_hf_lora.py) one after the other in fresh processes, alternating which goes
first, so both see the same machine state. Figures are medians over the rounds; ratios are
mindqwen / peer (tokens/s: > 1 is faster; peak RSS: < 1 is leaner). Not part of CI.

    python benchmarks/compare.py --peer /path/to/peer-venv/bin/python [--rounds 2]
                                 [--workloads lora,full,gen] [--shape qwen2.5-0.5b] [--batch 1 --seq 512]
                                 [--layers N] [--no-fusion]

The peer builds the same dimensions (``--vocab-size``, ``--hidden-size``, … from the shape); it
models the Qwen2 architecture, so Qwen3 shapes are not compared, except ``bench-small-moe``,
which ``benchmarks/peers/hf_moe.py`` builds as a Qwen3-MoE (training only, HF's loss plus the
load-balancing loss as mindqwen trains).

The peer's virtualenv needs torch's CPU wheel (``pip install torch==2.13.0 --index-url
https://download.pytorch.org/whl/cpu``), transformers and peft: never the project's own.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List

from train import SHAPES, shape_config

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_SCRIPT = os.path.join(HERE, "..", "..", "shared", "bench", "peer_hf_lora.py")
# Qwen3-MoE shapes (bench-small-moe); in its own folder: benchmarks/profile.py would shadow the stdlib
MOE_PEER_SCRIPT = os.path.join(HERE, "peers", "hf_moe.py")
FIGURES = {"train": ("tokens_per_s", "step_ms", "peak_rss_mb", "mfu", "compile_s", "build_s"),
           "gen": ("tokens_per_s", "decode_tokens_per_s", "peak_rss_mb", "first_token_s", "compile_s",
                   "floor_tokens_per_s", "decode_of_floor")}


def peer_shape_flags(shape: str, layers: int) -> List[str]:
    """The peer's model flags for a benchmark shape."""
    config = shape_config(shape, layers)
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps"]
    if config.get("model_type") == "qwen3_moe":
        keys += ["head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size"]
    elif config.get("model_type", "qwen2") != "qwen2":
        sys.exit(f"--shape {shape}: the peers model Qwen2 and Qwen3-MoE")
    flags = [f"--{k.replace('_', '-')}={config[k]}" for k in keys]
    return flags + ([] if config["tie_word_embeddings"] else ["--no-tie-word-embeddings"])


def commands(workload: str, peer_python: str, args: argparse.Namespace) -> Dict[str, List[str]]:
    """(mindqwen, peer) command lines of one workload."""
    shape = ["--shape", args.shape, *(["--layers", str(args.layers)] if args.layers else [])]
    moe = shape_config(args.shape).get("model_type") == "qwen3_moe"
    script = MOE_PEER_SCRIPT if moe else args.peer_script
    peer = [peer_python, script, "--threads", "2", *peer_shape_flags(args.shape, args.layers)]
    if moe and workload == "gen":
        sys.exit("--shape bench-small-moe: the MoE peer measures training only (--workloads lora,full)")
    if moe:  # the MoE peer has no contention machinery: plain timed steps, as mindqwen's
        full = ["--full"] if workload == "full" else []
        capacity = [] if args.moe_capacity_factor is None else ["--moe-capacity-factor", str(args.moe_capacity_factor)]
        return {"mindqwen": [sys.executable, os.path.join(HERE, "train.py"), "--threads", "2", *full, *shape, *capacity,
                             "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)],
                "peer": [*peer, *full, "--aux", "--batch", str(args.batch), "--seq", str(args.seq),
                         "--steps", str(args.steps)]}
    if workload == "gen":
        return {"mindqwen": [sys.executable, os.path.join(HERE, "generate.py"), "--batches", "1", "--repeats", "3", *shape],
                "peer": [*peer, "--gen", "--clean-steps", "3", "--steps", "5"]}
    full = ["--full"] if workload == "full" else []
    size = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    return {"mindqwen": [sys.executable, os.path.join(HERE, "train.py"), "--threads", "2", *full, *shape, *size,
                         *([] if args.fusion else ["--no-fusion"])],
            "peer": [*peer, "--clean-steps", str(args.steps - 3), *full, *size]}


def run(cmd: List[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "batch_1" in out:  # benchmarks/generate.py nests per batch size
        out = {**out["batch_1"], **{k: out.get(k) for k in ("peak_rss_mb", "floor_tokens_per_s", "decode_of_floor")}}
    return out


def compare(workload: str, cmds: Dict[str, List[str]], rounds: int) -> dict:
    kind = "gen" if workload == "gen" else "train"
    seen: Dict[str, List[dict]] = {"mindqwen": [], "peer": []}
    for i in range(rounds):
        for who in (("mindqwen", "peer") if i % 2 == 0 else ("peer", "mindqwen")):
            seen[who].append(run(cmds[who]))
            print(f"{workload} round {i + 1}/{rounds} {who}: {seen[who][-1].get('tokens_per_s')} tokens/s",
                  file=sys.stderr, flush=True)
    result = {}
    for who, outs in seen.items():
        result[who] = {k: statistics.median(o[k] for o in outs) for k in FIGURES[kind]
                       if all(o.get(k) is not None for o in outs)}
    mine, theirs = result["mindqwen"], result["peer"]
    for key in ("tokens_per_s", "decode_tokens_per_s", "peak_rss_mb"):
        if key in mine and key in theirs:
            result[f"{key}_ratio"] = round(mine[key] / theirs[key], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", required=True, help="python of the peer's virtualenv (torch + transformers + peft)")
    ap.add_argument("--peer-script", default=PEER_SCRIPT)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", default="lora,full,gen")
    ap.add_argument("--shape", default="bench-small", choices=SHAPES)
    ap.add_argument("--layers", type=int, default=0, help="override the shape's depth")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=13, help="train steps per run (3 warm-up)")
    ap.add_argument("--no-fusion", dest="fusion", action="store_false", help="mindqwen without CPU fusion")
    ap.add_argument("--moe-capacity-factor", type=float, default=None,
                    help="bench-small-moe: mindqwen's QwenConfig.moe_capacity_factor (HF has none: exact)")
    args = ap.parse_args()
    out = {"benchmark": "compare", "rounds": args.rounds, "fusion": args.fusion, "shape": args.shape,
           "moe_capacity_factor": args.moe_capacity_factor,
           "layers": args.layers or None, "batch": args.batch, "seq": args.seq}
    for workload in args.workloads.split(","):
        if workload not in ("lora", "full", "gen"):
            sys.exit(f"unknown workload {workload!r}: lora, full or gen")
        out[workload] = compare(workload, commands(workload, args.peer, args), args.rounds)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
