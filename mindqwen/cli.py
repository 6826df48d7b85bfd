"""``mindqwen <command>``: a dictionary of subcommands to ordinary functions."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional


def cmd_generate(argv: List[str]) -> None:
    """Greedy generation from an HF checkpoint folder, prompt given as token ids."""
    p = argparse.ArgumentParser(
        prog="mindqwen generate", description=cmd_generate.__doc__,
        epilog="example: mindqwen generate tests/fixtures/qwen2_tiny/base --input-ids 483,320,350 "
               "--max-new-tokens 16")
    p.add_argument("checkpoint", help="HF folder: config.json + model.safetensors")
    p.add_argument("--input-ids", required=True, help="comma-separated prompt token ids")
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    import mindspore as ms
    from mindqwen import from_pretrained
    from mindqwen.generate import generate
    ms.set_device("CPU") if ms.get_context("device_target") == "CPU" else None
    try:
        prompt = [[int(t) for t in args.input_ids.split(",")]]
    except ValueError:
        raise ValueError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from None
    model = from_pretrained(args.checkpoint)
    out = generate(model, prompt, max_new_tokens=args.max_new_tokens, progress=True)
    print("prompt:   ", prompt[0])
    print("generated:", out[0, len(prompt[0]):].tolist())


COMMANDS: Dict[str, Callable[[List[str]], None]] = {"generate": cmd_generate}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: mindqwen {" + ",".join(COMMANDS) + "} ...  (--help on each)")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        COMMANDS[argv[0]](argv[1:])
    except (ValueError, OSError) as e:  # ConfigError / CheckpointError are ValueErrors
        if debug:
            raise
        print(f"mindqwen {argv[0]}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
