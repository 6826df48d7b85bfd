"""``converter_lite`` configs for Ascend targets, the exact command lines, and running them.

One INI file per graph, in the layout of the MindSpore Lite Ascend converter
(docs/lite/docs/source_en/mindir/converter_tool_ascend.md) and its Qwen2.5 example:

    [ascend_context]      input_format=ND, precision_mode (Lite spelling)
    [acl_init_options]    ge.socVersion, ge.exec.precision_mode
    [acl_build_options]   input_format=ND, input_shape (-1 = dynamic), ge.dynamicDims (gears)

Every exported graph has a dynamic batch axis (and prefill a dynamic sequence axis, or one graph
per bucket); each gear fixes them to one (batch size, bucket) pair, so the device runs static
shapes and prompts are padded up to a gear. A gear lists one value per ``-1`` in ``input_shape``,
in input order.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional

TARGETS = ("Ascend310", "Ascend310P", "Ascend910", "Ascend910B")
MAX_GEARS = 100  # converter_lite's limit on dynamic_dims / ge.dynamicDims gears
# ge.exec.precision_mode → [ascend_context] precision_mode (the same policy, Lite's spelling).
PRECISION_MODES = {"force_fp32": "enforce_fp32", "force_fp16": "enforce_fp16",
                   "must_keep_origin_dtype": "enforce_origin", "allow_mix_precision": "preferred_optimal",
                   "allow_fp32_to_fp16": "preferred_fp32"}


def check_target(target: str, precision_mode: Optional[str]) -> None:
    if target not in TARGETS:
        raise ValueError(f"export target must be one of {TARGETS}, got {target!r}")
    if precision_mode is not None and precision_mode not in PRECISION_MODES:
        raise ValueError(f"precision_mode must be one of {sorted(PRECISION_MODES)} "
                         f"(ge.exec.precision_mode spelling), got {precision_mode!r}")


def default_precision(dtype: str) -> str:
    """fp16 graphs keep their own casts (fp32 softmax/RMSNorm/rotary): ``must_keep_origin_dtype``.
    ``force_fp16`` would cast those to fp16 too, which overflows on Qwen's attention scores."""
    return "must_keep_origin_dtype" if dtype == "float16" else "force_fp32"


def gears(graph: dict, batch_sizes: List[int], buckets: List[int]) -> List[List[int]]:
    """One gear per (batch, bucket): a value for every -1 of every input, in input order.
    Dynamic axis 0 of a (batch, …) input and axis 1 of the cache and the linear-attention states
    (layers first) are the batch; others the sequence."""
    out = []
    for b in batch_sizes:
        for s in (buckets if graph["inputs"][0]["shape"][1] < 0 else [None]):
            gear = []
            for i in graph["inputs"]:
                for axis, d in enumerate(i["shape"]):
                    if d < 0:
                        layers_first = i["name"].endswith(("_cache", "_state"))
                        is_batch = (axis == 1) if layers_first else (axis == 0 and len(i["shape"]) > 1)
                        gear.append(b if is_batch else s)
            out.append(gear)
    return out


def config_text(name: str, graph: dict, manifest: dict, target: str, precision_mode: str) -> str:
    shape = ";".join(f"{i['name']}:{','.join(str(d) for d in i['shape'])}" for i in graph["inputs"])
    dims = ";".join(",".join(str(v) for v in g)
                    for g in gears(graph, manifest["batch_sizes"], manifest["seq_buckets"]))
    return "\n".join([
        f"# converter_lite config for {graph['file']} → {target} (written by mindqwen export)",
        f"# {name}: {manifest['dtype']} weights; gears = batch sizes {manifest['batch_sizes']}"
        + (f" × prompt buckets {manifest['seq_buckets']}" if graph["inputs"][0]["shape"][1] < 0 else ""),
        "[ascend_context]",
        "input_format=ND",
        f"precision_mode={PRECISION_MODES[precision_mode]}",
        "",
        "[acl_init_options]",
        f"ge.socVersion={target}",
        f"ge.exec.precision_mode={precision_mode}",
        "",
        "[acl_build_options]",
        "input_format=ND",
        f"input_shape={shape}",
        f"ge.dynamicDims={dims}",
        f"ge.exec.precision_mode={precision_mode}",
        ""])


def command(graph_file: str, config: str, output: str) -> List[str]:
    """The converter_lite command line (paths relative to the export folder)."""
    return ["converter_lite", "--fmk=MINDIR", f"--modelFile={graph_file}", f"--outputFile={output}",
            "--saveType=MINDIR", "--optimize=ascend_oriented", f"--configFile={config}"]


def write_configs(manifest: dict, folder: str, target: str, precision_mode: Optional[str]) -> dict:
    """Write lite/<graph>.cfg and lite/convert.sh; run converter_lite if it is on PATH."""
    precision_mode = precision_mode or default_precision(manifest["dtype"])
    os.makedirs(os.path.join(folder, "lite"), exist_ok=True)
    configs, outputs, commands = {}, {}, []
    for name, graph in manifest["graphs"].items():
        configs[name] = f"lite/{name}.cfg"
        outputs[name] = f"lite/{name}_{target.lower()}.mindir"  # converter_lite appends .mindir
        with open(os.path.join(folder, configs[name]), "w") as f:
            f.write(config_text(name, graph, manifest, target, precision_mode))
        commands.append(command(graph["file"], configs[name], outputs[name][:-len(".mindir")]))
    with open(os.path.join(folder, "lite", "convert.sh"), "w") as f:
        f.write("#!/bin/sh\n# Run from the export folder on a machine with MindSpore Lite (converter_lite).\n"
                "set -e\ncd \"$(dirname \"$0\")/..\"\n" + "".join(" ".join(c) + "\n" for c in commands))
    os.chmod(os.path.join(folder, "lite", "convert.sh"), 0o755)
    converted = shutil.which("converter_lite") is not None
    for c in commands if converted else []:
        r = subprocess.run(c, cwd=folder, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(c)} failed:\n{r.stdout[-1500:]}{r.stderr[-1500:]}")
    return {"target": target, "precision_mode": precision_mode, "configs": configs, "outputs": outputs,
            "commands": [" ".join(c) for c in commands], "converted": converted}
