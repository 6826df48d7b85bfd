"""LoRA adapters between PEFT and mindformers namings.

    # mindformers (legacy lora_a/lora_b on wq…, or Mcore lora_A/lora_B, fused linear_qkv allowed) → PEFT folder
    python ckpt_tools/convert_adapter.py ADAPTER.ckpt|.safetensors OUT_DIR --from mindformers-mcore \\
        --config HF_FOLDER --r 8 --lora-alpha 16 [--qkv interleaved] [--mlp interleaved]
    # PEFT folder → mindformers legacy naming (a .ckpt or .safetensors file)
    python ckpt_tools/convert_adapter.py PEFT_DIR OUT.safetensors --to mindformers

A fused linear_qkv / linear_fc1 LoRA exports exactly: every projection gets A and its rows of B.
"""
import argparse
import json
import os
import sys

from mindqwen.config import QwenConfig
from mindqwen.io.adapters import mindformers_to_peft, peft_to_mindformers
from mindqwen.io.safetensors import SafetensorsFile, save_file
from mindqwen.io.convert import lazy, part_rows

TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def read(path: str) -> dict:
    """Adapter tensors of a .safetensors file (no MindSpore needed) or a .ckpt."""
    if path.endswith(".ckpt"):
        from mindqwen.io.convert import read_state
        return {k: t.load() for k, t in read_state(path).items()}
    f = SafetensorsFile(path)
    return {k: f.get(k) for k in f.keys()}


def write(path: str, tensors: dict) -> None:
    if path.endswith(".ckpt"):
        from mindqwen.io.convert import write_file
        write_file(path, lazy(tensors), False)
    elif path.endswith(".safetensors"):
        save_file(tensors, path)
    else:
        raise ValueError(f"{path}: write a .safetensors or .ckpt file")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source")
    ap.add_argument("target")
    ap.add_argument("--from", dest="src", choices=["peft", "mindformers", "mindformers-mcore"], default="peft")
    ap.add_argument("--to", dest="dst", choices=["peft", "mindformers"], default="peft")
    ap.add_argument("--config", help="HF folder or config.json of the base model (mindformers sources)")
    ap.add_argument("--r", type=int, help="LoRA rank (mindformers sources: written to adapter_config.json)")
    ap.add_argument("--lora-alpha", type=float, help="LoRA alpha (mindformers sources)")
    ap.add_argument("--qkv", choices=["contiguous", "interleaved"])
    ap.add_argument("--mlp", choices=["contiguous", "interleaved"])
    args = ap.parse_args(argv)
    try:
        if args.src == "peft" and args.dst == "mindformers":
            write(args.target, peft_to_mindformers(read(os.path.join(args.source, "adapter_model.safetensors"))))
        elif args.src != "peft" and args.dst == "peft":
            if not (args.config and args.r and args.lora_alpha):
                raise ValueError("a mindformers adapter needs --config, --r and --lora-alpha")
            cfg = QwenConfig.from_hf(args.config)
            rows = part_rows(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size)
            peft = mindformers_to_peft(read(args.source), args.src, cfg.num_key_value_heads, rows, args.qkv, args.mlp)
            targets = sorted({k.split(".")[-3] for k in peft} & TARGETS)
            os.makedirs(args.target, exist_ok=False)
            save_file(peft, os.path.join(args.target, "adapter_model.safetensors"))
            with open(os.path.join(args.target, "adapter_config.json"), "w") as f:
                json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": args.r, "lora_alpha": args.lora_alpha,
                           "target_modules": targets, "bias": "none"}, f, indent=2)
        else:
            raise ValueError(f"converting {args.src} → {args.dst} is not supported (peft ⇄ mindformers)")
    except (ValueError, KeyError, OSError) as e:
        print(f"convert_adapter: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
