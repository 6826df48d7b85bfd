"""Process-wide MindSpore settings that mindqwen applies by default on the CPU.

MindSpore's CPU kernels keep per-kernel index buffers for every broadcasting element-wise op;
graph-kernel (AKG) fusion merges those chains into single kernels, which halves the peak memory
of a training step and makes it faster (docs/performance.md). Two settings make it work:

- ``OMP_WAIT_POLICY=PASSIVE``: the fused kernels run on libgomp threads, and spinning ones cost
  ~40% on 2 cores (bench-small step 1.2–1.4 s against 0.85–0.9 s). libgomp reads it once, when
  ``import mindspore`` loads it, so ``import mindqwen`` sets it only while MindSpore is not
  imported yet.
- ``MS_DEV_GRAPH_KERNEL_FLAGS`` (and AKG's own variables): read at each graph compile, so they
  are set when a mindqwen model is built on the CPU.

Variables the user has set are never overridden: ``MS_DEV_GRAPH_KERNEL_FLAGS=--opt_level=0``
(or ``disable_cpu_fusion()`` before the model is built) turns fusion off.

AKG builds each fused kernel once and keeps it in ``cache_dir()`` (``$MINDQWEN_CACHE``, default
``~/.cache/mindqwen``), one folder per MindSpore version, which every later run reuses whatever
its working directory; the working directory stays clean.

Fusion and MindSpore's compile cache (``trainer.compile_cache``) exclude each other in one
process: the first fused compile fixes MindSpore's cache folder (to the fused-kernel folder), so
later cached graphs would land there instead of in their own folders (measured).
"""
import atexit
import functools
import os
import sys
import warnings

# --opt_level=2 turns fusion on for the CPU; Exp/Log stay unfused (fused, they moved the loss by
# 3e-5), and so does Cast (AKG fails to build fused fp16 casts: "composite_topi.cc: Check failed:
# attr->IsInstance<StringImm>()"; unfused, fp32 steps measured the same), and Transpose (fused
# Transpose clusters in the ViT's backward gave gradients of 1e15-1e37 where eager ones are ~1e-7,
# changing run to run: tests/test_multimodal.py compares them); small clusters keep AKG's compile
# of each fused kernel short.
CPU_FUSION_FLAGS = "--opt_level=2 --disable_cluster_ops=Exp,Log,Cast,Transpose --composite_op_limit_size=50"

_imported_after_mindspore = "mindspore" in sys.modules


def prepare_process() -> None:
    """Called by ``import mindqwen``: settings that only count before MindSpore loads."""
    if not _imported_after_mindspore:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def fusion_enabled() -> bool:
    """Whether graphs compiled now get CPU graph-kernel fusion."""
    flags = os.environ.get("MS_DEV_GRAPH_KERNEL_FLAGS", "")
    return bool(flags) and "--opt_level=0" not in flags


def disable_cpu_fusion() -> None:
    """Compile without graph-kernel fusion from now on (before the model is built: the compile
    cache needs a process that has compiled no fused graph)."""
    os.environ["MS_DEV_GRAPH_KERNEL_FLAGS"] = "--opt_level=0"


def cache_dir() -> str:
    """mindqwen's cache folder: ``$MINDQWEN_CACHE``, else ``$XDG_CACHE_HOME/mindqwen``, else
    ``~/.cache/mindqwen``."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mindqwen")
    return os.environ.get("MINDQWEN_CACHE") or default


def use_cpu_fusion() -> None:
    """Turn on graph-kernel fusion for the graphs this process compiles from now on (CPU only).

    AKG builds the fused kernels into ``<cache_dir()>/kernels-ms<version>/akg_kernel_meta/``,
    where later runs reuse them. MindSpore reads that folder from ``MS_COMPILER_CACHE_PATH`` at
    its first fused compile and keeps it for the process; ``trainer.compile_cache`` (which turns
    fusion off) sets its own folders instead.
    """
    if "MS_DEV_GRAPH_KERNEL_FLAGS" not in os.environ and _imported_after_mindspore \
            and "OMP_WAIT_POLICY" not in os.environ:
        warnings.warn("mindspore was imported before mindqwen, so its OpenMP threads spin: CPU training "
                      "runs ~40% slower. Import mindqwen first, or export OMP_WAIT_POLICY=PASSIVE.",
                      stacklevel=3)
    os.environ.setdefault("MS_DEV_GRAPH_KERNEL_FLAGS", CPU_FUSION_FLAGS)
    os.environ.setdefault("AKG_WHITE_LIST_PATH", "/")  # silences AKG's tiling-repository lines on stdout
    if fusion_enabled() and "MS_COMPILER_CACHE_PATH" not in os.environ:
        import mindspore
        folder = os.path.join(cache_dir(), f"kernels-ms{mindspore.__version__}")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:  # a read-only home: the kernels go to the working directory, as MindSpore's default
            warnings.warn(f"cannot create the kernel cache {folder} ({e.strerror}): fused kernels are built into "
                          "the working directory; set MINDQWEN_CACHE to a writable folder", stacklevel=3)
            return
        os.environ["MS_COMPILER_CACHE_PATH"] = folder
        _remove_akg_log_at_exit()


@functools.lru_cache(maxsize=1)
def _remove_akg_log_at_exit() -> None:
    """AKG's polyhedral pass writes ``dsa_transfrom.log`` (its schedule timings) into the working
    directory of MindSpore's kernel-build server whenever it builds a new kernel; the server is
    MindSpore's own process, started in the working directory of the moment. The log is removed
    when this process exits, unless it was there before."""
    log = os.path.abspath("dsa_transfrom.log")
    if not os.path.exists(log):
        atexit.register(lambda: os.path.exists(log) and os.remove(log))
