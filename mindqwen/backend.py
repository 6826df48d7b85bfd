"""Process-wide MindSpore settings that mindqwen applies by default on the CPU.

MindSpore's CPU kernels keep per-kernel index buffers for every broadcasting element-wise op;
graph-kernel (AKG) fusion merges those chains into single kernels, which halves the peak memory
of a training step and makes it faster (docs/performance.md). Two settings make it work:

- ``OMP_WAIT_POLICY=PASSIVE``: the fused kernels run on libgomp threads, and spinning ones cost
  ~40% on 2 cores (bench-small step 1.2–1.4 s against 0.85–0.9 s). libgomp reads it once, when
  ``import mindspore`` loads it, so ``import mindqwen`` sets it only while MindSpore is not
  imported yet.
- ``MS_DEV_GRAPH_KERNEL_FLAGS`` (and AKG's own variables): read at each graph compile.

Both are set once, by ``import mindqwen`` (``prepare_process``): this module is the one place
that writes process settings. Fusion is left off where an Ascend runtime is installed (its
environment, ``ASCEND_HOME_PATH`` or ``ASCEND_TOOLKIT_HOME``, is set): Ascend compiles its own
way. Variables the user has set are never overridden: ``MS_DEV_GRAPH_KERNEL_FLAGS=--opt_level=0``
(or ``disable_cpu_fusion()`` before the first compile) turns fusion off.

AKG builds each fused kernel once and keeps it in ``cache_dir()`` (``$MINDQWEN_CACHE``, default
``~/.cache/mindqwen``), one folder per MindSpore version, which every later run reuses whatever
its working directory; the working directory stays clean.

Fusion and MindSpore's compile cache (``trainer.compile_cache``) exclude each other in one
process: the first fused compile fixes MindSpore's cache folder (to the fused-kernel folder), so
later cached graphs would land there instead of in their own folders (measured).
"""
import atexit
import contextlib
import functools
import os
import sys
import warnings
from typing import Iterator, Optional

# --opt_level=2 turns fusion on for the CPU; Exp/Log stay unfused (fused, they moved the loss by
# 3e-5), and so does Cast (AKG fails to build fused fp16 casts: "composite_topi.cc: Check failed:
# attr->IsInstance<StringImm>()"; unfused, fp32 steps measured the same), and Transpose (fused
# Transpose clusters in the ViT's backward gave gradients of 1e15-1e37 where eager ones are ~1e-7,
# changing run to run: tests/test_multimodal.py compares them); small clusters keep AKG's compile
# of each fused kernel short.
CPU_FUSION_FLAGS = "--opt_level=2 --disable_cluster_ops=Exp,Log,Cast,Transpose --composite_op_limit_size=50"

_imported_after_mindspore = "mindspore" in sys.modules


ASCEND_RUNTIME_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")  # set by the CANN toolkit's set_env.sh
_kernel_cache_set = False  # whether use_cpu_fusion set MS_COMPILER_CACHE_PATH (disable_cpu_fusion unsets it)


def on_ascend() -> bool:
    """Whether the CANN toolkit's environment is set (an Ascend runtime is there)."""
    return any(v in os.environ for v in ASCEND_RUNTIME_VARS)


def prepare_process() -> None:
    """Called once, by ``import mindqwen``: OpenMP's wait policy (it only counts before MindSpore
    loads) and, without an Ascend runtime, CPU graph-kernel fusion."""
    if not _imported_after_mindspore:
        _default_env("OMP_WAIT_POLICY", "PASSIVE")
    if not on_ascend():
        use_cpu_fusion()


def fusion_enabled() -> bool:
    """Whether graphs compiled now get CPU graph-kernel fusion."""
    flags = os.environ.get("MS_DEV_GRAPH_KERNEL_FLAGS", "")
    return bool(flags) and "--opt_level=0" not in flags


def disable_cpu_fusion() -> None:
    """Compile without graph-kernel fusion from now on (before the first compile: the compile
    cache needs a process that has compiled no fused graph)."""
    global _kernel_cache_set
    _set_env("MS_DEV_GRAPH_KERNEL_FLAGS", "--opt_level=0")
    if _kernel_cache_set:  # the fused kernels' folder would become MindSpore's cache folder
        _set_env("MS_COMPILER_CACHE_PATH", None)
        _kernel_cache_set = False


def cache_dir() -> str:
    """mindqwen's cache folder: ``$MINDQWEN_CACHE``, else ``$XDG_CACHE_HOME/mindqwen``, else
    ``~/.cache/mindqwen``."""
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mindqwen")
    return os.environ.get("MINDQWEN_CACHE") or default


def use_cpu_fusion() -> None:
    """Turn on graph-kernel fusion for the graphs this process compiles from now on (CPU only;
    ``import mindqwen`` does).

    AKG builds the fused kernels into ``<cache_dir()>/kernels-ms<version>/akg_kernel_meta/``,
    where later runs reuse them. MindSpore reads that folder from ``MS_COMPILER_CACHE_PATH`` at
    its first fused compile and keeps it for the process; ``trainer.compile_cache`` (which turns
    fusion off) sets its own folders instead.
    """
    global _kernel_cache_set
    if "MS_DEV_GRAPH_KERNEL_FLAGS" not in os.environ and _imported_after_mindspore \
            and "OMP_WAIT_POLICY" not in os.environ:
        warnings.warn("mindspore was imported before mindqwen, so its OpenMP threads spin: CPU training "
                      "runs ~40% slower. Import mindqwen first, or export OMP_WAIT_POLICY=PASSIVE.",
                      stacklevel=3)
    _default_env("MS_DEV_GRAPH_KERNEL_FLAGS", CPU_FUSION_FLAGS)
    _default_env("AKG_WHITE_LIST_PATH", "/")  # silences AKG's tiling-repository lines on stdout
    if fusion_enabled():  # this process's kernel builds write the log, whoever chose the kernel cache
        _remove_akg_log_at_exit()  # (a child of a mindqwen process inherits MS_COMPILER_CACHE_PATH)
    if fusion_enabled() and "MS_COMPILER_CACHE_PATH" not in os.environ:
        folder = os.path.join(cache_dir(), f"kernels-ms{_mindspore_version()}")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:  # a read-only home: the kernels go to the working directory, as MindSpore's default
            warnings.warn(f"cannot create the kernel cache {folder} ({e.strerror}): fused kernels are built into "
                          "the working directory; set MINDQWEN_CACHE to a writable folder", stacklevel=3)
            return
        _set_env("MS_COMPILER_CACHE_PATH", folder)
        _kernel_cache_set = True


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Within the block, the process environment has ``values``; what was there comes back."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        _set_env(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            _set_env(k, v)


def _set_env(name: str, value: Optional[str]) -> None:
    """The one writer of the process environment in mindqwen (None removes ``name``): MindSpore,
    OpenMP and AKG read their settings from it."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _default_env(name: str, value: str) -> None:
    """``value`` unless the user has set ``name``."""
    if name not in os.environ:
        _set_env(name, value)


def _mindspore_version() -> str:
    """MindSpore's version, without importing it (``import mindqwen`` stays light)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("mindspore")
    except PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def _remove_akg_log_at_exit() -> None:
    """AKG's polyhedral pass writes ``dsa_transfrom.log`` (its schedule timings) into the working
    directory of MindSpore's kernel-build server whenever it builds a new kernel; the server is
    MindSpore's own process, started in the working directory of the moment. The log is removed
    when this process exits, unless it was there before."""
    log = os.path.abspath("dsa_transfrom.log")
    if not os.path.exists(log):
        atexit.register(lambda: os.path.exists(log) and os.remove(log))
