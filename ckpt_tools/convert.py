"""Checkpoint conversion (same as ``mindqwen convert``): HF ⇄ MindSpore .ckpt ⇄ mindformers.

    python ckpt_tools/convert.py SOURCE TARGET --from hf --to mindformers --qkv interleaved --mlp interleaved
"""
import sys

from mindqwen.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
