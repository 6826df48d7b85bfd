"""``mindqwen doctor``: whether this install computes what it should on this device.

It writes down the versions (Python, NumPy, MindSpore, CANN and the driver where present, mindqwen
and its extras) and the devices, then runs numbered checks against golden models shipped with the
package (``goldens/``: a dense Qwen2 with a PEFT LoRA adapter, a Qwen3 mixture of experts, the
original Qwen layout, a Qwen3.5 hybrid (Gated DeltaNet and gated attention layers); their references
come from HF transformers + PEFT, and for the original Qwen from a float64 numpy forward of its
published math). Each check is PASS, FAIL or SKIP, with
its figures and, for SKIP, the reason:

1. logits of the golden models in float32, and in the device's low-precision dtype;
2. a graph-mode LoRA train step: the loss and every LoRA gradient, and its compile time;
3. KV-cache generation (and the hybrid's linear-attention states): greedy tokens equal the golden
   and a full recomputation;
4. MindIR export against the eager model (the dense and the hybrid), and ``converter_lite`` where
   it is installed;
5. several devices: data parallel against one device (and, on Ascend, tensor and pipeline parallel);
6. a mixture of experts: the expert path the device runs against the batched one.

The report (``--report``) holds every figure; the exit status is 0 only when nothing fails.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, List, Optional, Tuple

import numpy as np

GOLDENS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goldens")
# float32: two correct implementations that sum in another order differ by ~1e-5 on these logits
# (|x| up to ~10); 5e-5 leaves room for the device's kernels, anything larger is a bug.
LOGIT_TOL = 5e-5
# The hybrid's 150 tokens run through three chunks of its delta rule, relative to the largest logit:
# HF's own fp32 logits are 4.5e-6 off its float64 ones, and a device's fp32 exp in the decays adds up
# to 1.1e-5 (measured on the CPU with float64 decays turned off).
HYBRID_RTOL = 2e-5
GRAD_RTOL = 1e-4  # ‖Δgrad‖ / ‖grad‖ of a float32 backward
# Low precision, relative to the largest logit: unit roundoff u (fp16 2^-11, bf16 2^-8) grows
# through ~10 rounded matmuls and norms of two layers to a few u: 16u bounds it with room.
LOW_TOL = {"float16": 16 * 2.0 ** -11, "bfloat16": 16 * 2.0 ** -8}
EXTRAS = ("lm-eval", "fastapi", "uvicorn", "matplotlib", "pillow", "tokenizers")
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclasses.dataclass
class Result:
    """One check's outcome: ``figures`` are what it measured; ``reason`` why it failed or skipped."""

    number: int
    name: str
    status: str
    figures: dict = dataclasses.field(default_factory=dict)
    reason: str = ""
    seconds: float = 0.0


def golden(name: str, *parts: str) -> str:
    return os.path.join(GOLDENS, name, *parts)


def golden_arrays(name: str) -> dict:
    with np.load(golden(name, "golden.npz")) as z:
        return {k: z[k] for k in z.files}


# ---------------------------------------------------------------------------- environment
def environment(device: str) -> dict:
    """Versions and devices: what a bug report needs before any figure."""
    import mindspore as ms
    import mindqwen
    versions = {"python": platform.python_version(), "numpy": np.__version__, "mindspore": ms.__version__,
                "mindqwen": mindqwen.__version__, "platform": platform.platform()}
    for extra in EXTRAS:
        try:
            versions[extra] = importlib.metadata.version(extra)
        except importlib.metadata.PackageNotFoundError:
            versions[extra] = None
    versions.update(ascend_versions())
    return {"versions": versions, "device": device, "devices": device_facts(device)}


def ascend_versions() -> dict:
    """CANN (the toolkit's version.cfg / *install.info) and the NPU driver's version.info, where present."""
    found = {}
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
    places = {"cann": [os.path.join(home, f) for f in ("version.cfg", "ascend_toolkit_install.info")] if home else [],
              "npu_driver": ["/usr/local/Ascend/driver/version.info"]}
    for key, paths in places.items():
        for path in paths:
            if os.path.isfile(path):
                with open(path, encoding="utf-8", errors="replace") as f:
                    lines = [line.strip() for line in f if "version" in line.lower()]
                found[key] = lines[0].split("=", 1)[-1].strip() if lines else path
                break
    return found


def device_facts(device: str) -> dict:
    import mindspore as ms
    facts = {"count": ms.hal.device_count(device), "cpu_cores": os.cpu_count()}
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        facts["host_memory_gb"] = round(int(info["MemTotal"].split()[0]) / 2 ** 20, 1)
    except (OSError, KeyError, ValueError):
        pass
    if device == "Ascend":
        props = ms.hal.get_device_properties(0, device)
        facts.update(name=ms.hal.get_device_name(0, device), memory_gb=round(props.total_memory / 2 ** 30, 1))
    return facts


# ---------------------------------------------------------------------------- the checks
def check_logits(device: str) -> Tuple[str, dict, str]:
    """1. The golden models' logits in float32, and the dense one's in the low-precision dtype."""
    from mindqwen import from_pretrained
    from mindqwen.models.graph import configure
    figures = {}
    for name in ("dense", "moe", "qwen1", "qwen3_5"):
        ref = golden_arrays(name)
        model = from_pretrained(golden(name))
        keys = ["input_ids"] if "input_ids" in ref else ["input_ids_6", "input_ids_20"]
        for key in keys:
            logits, golden_logits = model(_tensor(ref[key])).asnumpy(), ref[key.replace("input_ids", "logits")]
            err = float(np.abs(logits - golden_logits).max())
            if model.config.is_hybrid:
                figures[f"{name}_max_rel"] = err / float(np.abs(golden_logits).max())
            else:
                figures[f"{name}{key[len('input_ids'):]}_max_abs"] = err
    low = low_dtype(device)
    ref = golden_arrays("dense")
    model = from_pretrained(golden("dense"))
    configure(model, compute_dtype=low)
    logits = model(_tensor(ref["input_ids"])).asnumpy().astype(np.float32)
    scale = float(np.abs(ref["logits"]).max())
    low_err = float(np.abs(logits - ref["logits"]).max()) / scale
    figures.update({f"dense_{low}_max_rel": low_err, f"{low}_tolerance": LOW_TOL[low], "float32_tolerance": LOGIT_TOL,
                    "hybrid_tolerance": HYBRID_RTOL,
                    f"dense_{low}_argmax_agreement": float(np.mean(logits.argmax(-1) == ref["logits"].argmax(-1)))})
    bad = [k for k, v in figures.items() if k.endswith("_max_abs") and not v <= LOGIT_TOL]  # NaN fails too
    bad += [f"dense_{low}_max_rel"] if not low_err <= LOW_TOL[low] else []
    bad += ["qwen3_5_max_rel"] if not figures["qwen3_5_max_rel"] <= HYBRID_RTOL else []
    return (FAIL, figures, f"beyond tolerance: {', '.join(bad)}") if bad else (PASS, figures, "")


def check_train_step(device: str) -> Tuple[str, dict, str]:
    """2. One graph-mode step of the dense model with the golden adapter: loss, every LoRA gradient."""
    import mindspore as ms
    from mindspore import nn
    from mindqwen import from_pretrained, load_adapter
    ref = golden_arrays("dense")
    model = load_adapter(from_pretrained(golden("dense")), golden("dense", "lora_adapter"))
    model.set_train(True)
    params = ms.ParameterTuple(model.trainable_params())
    grad_fn = ms.value_and_grad(model, None, params)

    class Step(nn.Cell):  # one graph: forward and backward
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.model = model

        def construct(self, ids):
            return grad_fn(ids, None, ids)

    ids = _tensor(ref["input_ids"])
    start = time.perf_counter()
    loss, grads = Step()(ids)
    compile_s = time.perf_counter() - start
    keys = ["grad/base_model.model." + p.name.replace(".lora_a", ".lora_A.weight").replace(".lora_b", ".lora_B.weight")
            for p in params]
    missing = [k for k in keys if k not in ref]
    rel = {k[len("grad/"):]: float(np.linalg.norm(g.asnumpy() - ref[k]) / np.linalg.norm(ref[k]))
           for k, g in zip(keys, grads) if k in ref}
    figures = {"loss": float(loss.asnumpy()), "loss_golden": float(ref["loss_lora"]),
               "loss_abs_diff": abs(float(loss.asnumpy()) - float(ref["loss_lora"])),
               "worst_grad_rel": max(rel.values(), default=float("nan")), "grad_rtol": GRAD_RTOL,
               "compile_and_step_s": round(compile_s, 2),
               "layers_compiled_once": all(layer.compiled_once is not None for layer in model.model.layers),
               "compile_once_mechanism": "lazy_inline" if device == "Ascend" else "no_inline"}
    if missing or not figures["loss_abs_diff"] <= LOGIT_TOL or not figures["worst_grad_rel"] <= GRAD_RTOL:
        return FAIL, figures, f"loss or gradients beyond tolerance{' (missing ' + str(missing) + ')' if missing else ''}"
    return PASS, figures, ""


def check_generation(device: str) -> Tuple[str, dict, str]:
    """3. Greedy KV-cache generation: the golden tokens, and the tokens of a full recomputation."""
    import mindspore as ms
    from mindqwen import from_pretrained, generate
    from mindqwen.models.graph import in_mode
    figures, bad = {}, []
    for name in ("dense", "moe", "qwen3_5"):
        ref = golden_arrays(name)
        model = from_pretrained(golden(name))
        prompt = ref.get("gen_prompt", ref["input_ids"])[:1]
        new = ref["gen_ids"].shape[1] - prompt.shape[1]
        cached = generate(model, prompt, max_new_tokens=new)
        seq = prompt.copy()
        with in_mode(ms.PYNATIVE_MODE):  # the reference: the whole row again for every token
            for _ in range(new):
                seq = np.concatenate([seq, model(_tensor(seq)).asnumpy()[:, -1:].argmax(-1)], 1)
        figures[f"{name}_equals_golden"] = bool(np.array_equal(cached, ref["gen_ids"]))
        figures[f"{name}_equals_full_recompute"] = bool(np.array_equal(cached, seq))
        bad += [k for k in (f"{name}_equals_golden", f"{name}_equals_full_recompute") if not figures[k]]
    return (FAIL, figures, f"tokens differ: {', '.join(bad)}") if bad else (PASS, figures, "")


def check_export(device: str) -> Tuple[str, dict, str]:
    """4. Prefill + decode MindIR of the dense and the hybrid model (its linear-attention states as
    graph inputs and outputs) against their eager forward (in a fresh process), and converter_lite
    when it is installed."""
    from mindqwen import from_pretrained
    from mindqwen.export import export_model
    figures, bad, converted = {}, [], True
    for name, buckets in (("dense", [16]), ("qwen3_5", [64])):
        with tempfile.TemporaryDirectory(prefix="mindqwen-doctor-") as tmp:
            folder = os.path.join(tmp, "export")
            manifest = export_model(from_pretrained(golden(name)), folder, batch_sizes=(1,),
                                    max_seq_len=buckets[-1] + 16, seq_buckets=buckets, dtype="float32")
            with open(os.path.join(folder, "parity.json"), encoding="utf-8") as f:
                parity = json.load(f)
        figures.update({f"{name}_max_abs_logit_diff": parity["eager_same_steps"]["max_abs_logit_diff"],
                        f"{name}_tokens_identical": parity["eager_same_steps"]["tokens_identical"]})
        bad += [] if parity["passed"] else [name]
        converted = converted and manifest["lite"]["converted"]
    figures["converter_lite"] = converted
    if bad:
        return FAIL, figures, f"the exported graphs disagree with the eager model: {', '.join(bad)}"
    if not converted:
        return PASS, figures, ("converter_lite is not on PATH, so the Ascend conversion was not run: install "
                               "MindSpore Lite's converter for this check to convert the graphs too")
    return PASS, figures, ""


def check_parallel(device: str, quick: bool) -> Tuple[str, dict, str]:
    """5. Two devices under msrun: a data-parallel step against one device (Ascend: tensor and
    pipeline parallel too)."""
    import mindspore as ms
    msrun = shutil.which("msrun") or os.path.join(os.path.dirname(sys.executable), "msrun")
    count = ms.hal.device_count(device)
    if quick:
        return SKIP, {"devices": count}, "--quick leaves out the multi-process runs (about a minute)"
    if not os.path.exists(msrun):
        return SKIP, {"devices": count}, "msrun (MindSpore's launcher) is not installed"
    if device == "Ascend" and count < 2:
        return SKIP, {"devices": count}, "one Ascend device is visible: nothing to split across"
    kinds = ["dp", "tp", "pp"] if device == "Ascend" else ["dp"]
    figures = {"devices": count}
    with tempfile.TemporaryDirectory(prefix="mindqwen-doctor-") as tmp:
        for i, kind in enumerate(kinds):
            single_losses, single = _parallel_run(kind, os.path.join(tmp, kind + "_single"), device, None, 0)
            losses, split = _parallel_run(kind, os.path.join(tmp, kind), device, msrun, i)
            figures[f"{kind}_max_loss_diff"] = float(np.abs(np.subtract(losses, single_losses)).max())
            if kind == "dp":  # every rank holds whole parameters (sharded ones are slices: losses only)
                figures["dp_max_param_diff"] = max(float(np.abs(split[k] - single[k]).max()) for k in single)
    bad = [k for k, v in figures.items() if "_max_" in k and not v <= 1e-5]  # NaN fails too
    if bad:
        return FAIL, figures, f"differs from one device: {', '.join(bad)}"
    return PASS, figures, "" if device == "Ascend" else ("tensor and pipeline parallel not run: they need Ascend "
                                                        "(MindSpore's CPU backend runs data parallel only)")


def check_moe(device: str) -> Tuple[str, dict, str]:
    """6. The golden mixture of experts: the path this device runs against the batched expert path."""
    from mindqwen import from_pretrained
    from mindqwen.models.graph import configure
    ref = golden_arrays("moe")
    ids = _tensor(ref["input_ids"])
    model = from_pretrained(golden("moe"))
    device_path = model(ids).asnumpy()
    configure(model, batched_experts=True)
    batched = model(ids).asnumpy()
    figures = {"device_vs_batched_max_abs": float(np.abs(device_path - batched).max()),
               "device_vs_golden_max_abs": float(np.abs(device_path - ref["logits"]).max()),
               "batched_vs_golden_max_abs": float(np.abs(batched - ref["logits"]).max()), "tolerance": LOGIT_TOL}
    bad = [k for k, v in figures.items() if k.endswith("_max_abs") and not v <= LOGIT_TOL]  # NaN fails too
    return (FAIL, figures, f"beyond tolerance: {', '.join(bad)}") if bad else (PASS, figures, "")


CHECKS: List[Tuple[str, Callable]] = [
    ("logits of the golden models (float32, low precision)", check_logits),
    ("graph-mode LoRA train step: loss and gradients", check_train_step),
    ("KV-cache generation: golden tokens, full recomputation", check_generation),
    ("MindIR export against eager; converter_lite", check_export),
    ("several devices: data (tensor, pipeline) parallel", check_parallel),
    ("mixture of experts: the device's path against the batched one", check_moe),
]


def low_dtype(device: str) -> str:
    """The device's low-precision compute dtype: bfloat16 on Ascend; float16 elsewhere (the CPU
    computes in float32 and has no bfloat16 kernels: float16 checks the same cast path)."""
    return "bfloat16" if device == "Ascend" else "float16"


def _tensor(a: np.ndarray):
    import mindspore as ms
    return ms.Tensor(np.asarray(a, np.int32))


# ---------------------------------------------------------------------------- running
def run_doctor(device: str = "CPU", quick: bool = False, only: Optional[List[int]] = None,
               echo: Callable[[str], None] = print) -> dict:
    """Every check (or those numbered in ``only``) on ``device``; returns the report."""
    import mindspore as ms
    from mindqwen.models.graph import in_mode
    ms.set_device(device)
    report = {"environment": environment(device), "quick": quick, "checks": []}
    env = report["environment"]
    echo("versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v and k != "platform"))
    echo(f"devices: {device} × {env['devices']['count']}; " + ", ".join(
        f"{k} {v}" for k, v in env["devices"].items() if k != "count"))
    for number, (name, check) in enumerate(CHECKS, 1):
        if only and number not in only:
            continue
        start = time.perf_counter()
        try:
            with in_mode(ms.GRAPH_MODE):
                status, figures, reason = check(device, quick) if check is check_parallel else check(device)
        except Exception as e:  # a check that crashes has failed; the others still run
            status, figures = FAIL, {"traceback": traceback.format_exc(limit=-3)}
            reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        result = Result(number, name, status, figures, reason, round(time.perf_counter() - start, 1))
        report["checks"].append(dataclasses.asdict(result))
        echo(line(result))
    counts = {s: sum(c["status"] == s for c in report["checks"]) for s in (PASS, FAIL, SKIP)}
    report["summary"] = counts
    return report


def line(result: Result) -> str:
    """A check as one printed line (figures that are numbers, shortened)."""
    shown = ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in result.figures.items()
                      if isinstance(v, (int, float, bool)) and k != "traceback")
    text = f"{result.number}. {result.name:<62} {result.status}  ({result.seconds:.0f} s)"
    return text + (f"\n     {shown}" if shown else "") + (f"\n     {result.reason}" if result.reason else "")


# ---------------------------------------------------------------------------- parallel runs
def _parallel_run(kind: str, out: str, device: str, msrun: Optional[str], run: int) -> Tuple[list, dict]:
    """The losses of two steps of ``kind`` (dp | tp | pp) and rank 0's LoRA parameters after them
    ({name: array}): under msrun on two workers, or in this interpreter on one device (``msrun`` None)."""
    os.makedirs(out, exist_ok=True)
    worker = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py"), kind, out, device]
    if msrun:  # its workers run `python <script>`: this interpreter, first on PATH
        port = str(20000 + (os.getpid() * 3 + run) % 20000)  # a port per run: no wait on the last one's
        cmd = [msrun, "--worker_num=2", "--local_worker_num=2", "--master_addr=127.0.0.1", f"--master_port={port}",
               f"--log_dir={os.path.join(out, 'logs')}", "--join=True", *worker]
    else:
        cmd = [sys.executable, *worker]
    env = {**os.environ, "GLOG_v": "3", "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} run failed: {done.stderr[-800:]}")
    ranks = sorted((d for d in os.listdir(out) if d.startswith("rank_")), key=lambda d: int(d[5:]))
    logs = os.path.join(out, ranks[-1]) if ranks else out  # model parallel: the last stage's loss
    with open(os.path.join(logs, "metrics.jsonl"), encoding="utf-8") as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    with np.load(os.path.join(out, "params_0.npz")) as z:
        return losses, {k: z[k] for k in z.files}


def parallel_worker(kind: str, out: str, device: str) -> None:
    """One worker of ``_parallel_run``: two fit steps of a fresh LoRA (seed 0) on fixed rows."""
    import mindqwen  # noqa: F401  process settings before MindSpore
    import mindspore as ms
    from mindqwen import LoraConfig, TokenDataset, TrainerConfig, apply_lora, fit, from_pretrained
    from mindqwen.train.distributed import ParallelConfig, init_parallel, launched_by_msrun
    ms.set_device(device)
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    layouts = {"dp": ParallelConfig(), "tp": ParallelConfig(tensor_parallel=2),
               "pp": ParallelConfig(pipeline_parallel=2, pipeline_micro_batches=2)}
    parallel = layouts[kind] if launched_by_msrun() else ParallelConfig()  # alone: the one-device reference
    rank, world = init_parallel(parallel)
    model = apply_lora(from_pretrained(golden("qwen1" if kind == "pp" else "dense")), LoraConfig(r=4, lora_alpha=8))
    vocab = model.config.vocab_size
    data = TokenDataset(np.random.default_rng(0).integers(0, vocab, (16, 12)))
    batch = 4 // world if kind == "dp" else 4
    fit(model, data, TrainerConfig(max_steps=2, micro_batch_size=batch, lr=5e-3, warmup_steps=0, output_dir=out,
                                   progress=False), parallel=parallel)
    np.savez(os.path.join(out, f"params_{rank}.npz"), **{p.name: p.asnumpy() for p in model.trainable_params()})
