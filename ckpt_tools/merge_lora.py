"""Merge a PEFT adapter into its base (same as ``mindqwen merge``): base in any supported format.

    python ckpt_tools/merge_lora.py BASE ADAPTER OUTPUT [--from mindformers --config HF_FOLDER]
"""
import sys

from mindqwen.cli import main

if __name__ == "__main__":
    sys.exit(main(["merge", *sys.argv[1:]]))
