"""Peak memory of ``from_pretrained`` against the size of the model it loads.

Builds a ~150M-parameter Qwen2 (hidden 1024, 8 layers, vocab 32000), saves it as an HF folder
(bf16 on disk, so loading also widens to fp32), then loads it in a fresh process and reports the
peak RSS growth over a process that only imported MindSpore and mindqwen. One copy of the model
in fp32 is the floor. Prints one JSON line.

    python benchmarks/load_memory.py [--workdir DIR]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
              max_position_embeddings=2048)


def child(folder: str, load: bool) -> None:
    import mindspore as ms
    import mindqwen
    ms.set_device("CPU")
    if load:
        model = mindqwen.from_pretrained(folder)
        n = sum(int(p.size) for p in model.get_parameters())
    else:
        n = 0
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec from the parent.
    hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    print(json.dumps({"peak_rss_mb": hwm_kb / 1024, "params": n}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1] == "load")
    import mindspore as ms
    import mindqwen
    ms.set_device("CPU")
    work = args.workdir or tempfile.mkdtemp(prefix="mindqwen-load-")
    folder = os.path.join(work, "model")
    ms.set_seed(0)
    mindqwen.QwenForCausalLM(mindqwen.QwenConfig(**CONFIG)).save_pretrained(folder, dtype="bfloat16")

    def run(mode):
        out = subprocess.run([sys.executable, __file__, "--child", folder, mode], capture_output=True,
                             text=True, check=True, env={**os.environ, "GLOG_v": "3"})
        return json.loads(out.stdout.strip().splitlines()[-1])
    base, loaded = run("import"), run("load")
    fp32_mb = loaded["params"] * 4 / 2**20
    growth = loaded["peak_rss_mb"] - base["peak_rss_mb"]
    print(json.dumps({"benchmark": "from_pretrained_peak_memory", "params": loaded["params"],
                      "model_fp32_mb": round(fp32_mb), "file_bf16_mb": round(os.path.getsize(
                          os.path.join(folder, "model.safetensors")) / 2**20),
                      "peak_rss_growth_mb": round(growth), "growth_over_model": round(growth / fp32_mb, 2)}))


if __name__ == "__main__":
    main()
