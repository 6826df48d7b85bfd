"""LoRA: h = W0·x + b + (alpha/r)·B·A·x on a frozen base, with rsLoRA, DoRA and PiSSA.

``LoRALayer`` owns the base ``weight``/``bias`` Parameters of the ``Linear`` it replaces (the
same objects, so ``q_proj.weight`` keeps its key and its storage) and adds ``lora_a`` [r, in] and
``lora_b`` [out, r]. The family shares one base, ``LoraAdapter`` (adapter parameters, scaling,
dropout, merge/unmerge of ΔW = s·B·A): ``LoRALayer`` for a ``Linear``, ``DoRALayer`` (a
``LoRALayer`` with a magnitude vector) for ``use_dora``, ``ExpertLoRALayer`` for stacked
experts. ``apply_lora`` swaps layers in by ``insert_child_to_cell``; adapters move
to and from HF PEFT's format (``save_adapter`` / ``load_adapter``) without touching the user's
files.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import HeUniform, Normal, initializer

from mindqwen.io.atomic import staged_files
from mindqwen.io.experts import expert_slice, is_stacked, per_expert_names
from mindqwen.io.jsonfile import read_json
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile, save_file
from mindqwen.config import ExecutionOptions
from mindqwen.models.graph import invalidate_compiled_graphs, low_dtype
from mindqwen.models.moe import ExpertLinear, Router
from mindqwen.models.layers import Linear

DEFAULT_TARGETS = ("q_proj", "v_proj")  # Q and V keep most of the quality at the lowest cost
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head
INIT_MODES = ("default", "gaussian", "pissa")
BIAS_MODES = ("none", "lora_only", "all")
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ANY = None
# PEFT ``LoraConfig`` arguments that are not mindqwen fields: name → (the values that mean what
# mindqwen does, or _ANY for metadata; why any other value is refused). ``init_lora_weights`` is
# PEFT's spelling of ``init``.
PEFT_ARGUMENTS = {
    "task_type": (("CAUSAL_LM", None), "mindqwen adapts causal language models only"),
    "peft_type": (("LORA", None), "mindqwen implements LoRA (and DoRA) only"),
    "inference_mode": ((True, False), ""),  # apply_lora trains and load_adapter loads: the call decides
    "base_model_name_or_path": (_ANY, ""), "revision": (_ANY, ""), "auto_mapping": (_ANY, ""),
    "runtime_config": (_ANY, ""), "megatron_core": (_ANY, ""), "qalora_group_size": (_ANY, ""),
    "peft_version": (_ANY, ""),
    "fan_in_fan_out": ((False,), "Qwen's linear layers store [out, in] weights (it is for GPT-2's Conv1D)"),
    "lora_bias": ((False,), "a trainable bias on lora_B is not implemented"),
    "use_qalora": ((False,), "QA-LoRA needs a quantized base model"),
    "rank_pattern": ((None, {}), "per-module ranks are not implemented"),
    "alpha_pattern": ((None, {}), "per-module alphas are not implemented"),
    "layers_pattern": ((None, "layers", ["layers"]), "Qwen's decoder layers are model.layers"),
    "exclude_modules": ((None, [], ""), "not implemented: list the modules to adapt in target_modules"),
    "target_parameters": ((None, []), "LoRA on bare parameters is not implemented"),
    "trainable_token_indices": ((None, [], {}), "training single embedding rows is not implemented"),
    "layer_replication": ((None, []), "layer replication is not implemented"),
    "loftq_config": ((None, {}), "LoftQ needs a quantized base model"),
    "megatron_config": ((None, {}), "Megatron parallel layers are not used (see parallel: in a recipe)"),
    "eva_config": ((None, {}), "EVA initialisation is not implemented"),
    "corda_config": ((None, {}), "CorDA initialisation is not implemented"),
    "alora_invocation_tokens": ((None, []), "activated LoRA is not implemented"),
    "use_bdlora": ((None, False), "BD-LoRA is not implemented"),
    "ensure_weight_tying": ((None, False), "adapting tied embeddings together is not implemented"),
    **{name: ((None, {}), "this LoRA variant is not implemented")
       for name in ("arrow_config", "astra_config", "kasa_config", "lora_ga_config", "monteclora_config", "velora_config")},
}
INIT_LORA_WEIGHTS = {True: "default", "gaussian": "gaussian", "pissa": "pissa"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _peft_arguments(cls):
    """``cls(...)`` also takes PEFT's ``LoraConfig`` keywords (``PEFT_ARGUMENTS``): each is honoured
    or refused by name with the reason, never a ``TypeError``."""
    fields_init = cls.__init__

    @functools.wraps(fields_init)
    def __init__(self, *args, **kwargs):
        peft = {k: kwargs.pop(k) for k in list(kwargs) if k in PEFT_ARGUMENTS or k == "init_lora_weights"}
        if "init_lora_weights" in peft:
            value = peft.pop("init_lora_weights")
            if not isinstance(value, (bool, str)) or value not in INIT_LORA_WEIGHTS:
                raise ValueError(f"LoraConfig: init_lora_weights={value!r} is not supported "
                                 f"(True, 'gaussian' or 'pissa')")
            if "init" in kwargs and kwargs["init"] != INIT_LORA_WEIGHTS[value]:
                raise ValueError("LoraConfig: give init or init_lora_weights (PEFT's name for it), not both")
            kwargs["init"] = INIT_LORA_WEIGHTS[value]
        for key, value in peft.items():
            accepted, why = PEFT_ARGUMENTS[key]
            if accepted is not _ANY and not any(value == a and type(value) is type(a) for a in accepted):
                raise ValueError(f"LoraConfig: {key}={value!r} is not supported: {why}")
        fields_init(self, *args, **kwargs)
    cls.__init__ = __init__
    return cls


@_peft_arguments
@dataclass
class LoraConfig:
    """Which layers get LoRA and how (field names and meanings follow PEFT's ``LoraConfig``).

    PEFT's other keywords are taken too (``task_type="CAUSAL_LM"``, ``init_lora_weights``,
    ``inference_mode``, …, see ``PEFT_ARGUMENTS``): each is honoured or refused by name.

    Attributes:
        r: rank of A [r, in] and B [out, r].
        lora_alpha: scale numerator: scaling = alpha / r (rsLoRA: alpha / sqrt(r)).
        lora_dropout: dropout on the LoRA input while training.
        target_modules: module names (a module matches when its path ends with ``.name``),
            one regex matched against the full path (``model.layers.0.self_attn.q_proj``), or
            "all-linear": every linear layer but the output head (``lm_head``) and the stacked
            experts, as PEFT reads it (HF keeps a mixture's experts as 3-D tensors, not linear layers).
        layers_to_transform: only these decoder layer indices (None: all).
        bias: "none" | "lora_only" (biases of LoRA layers train) | "all" (every bias trains).
        modules_to_save: modules trained fully and saved with the adapter (e.g. ``lm_head``).
        use_rslora: rank-stabilised scaling alpha / sqrt(r).
        use_dora: weight-decomposed LoRA (a trainable magnitude per output row).
        init: "default" (kaiming-uniform A, zero B: the layer starts as the base), "gaussian"
            (A ~ N(0, 1/r), zero B) or "pissa" (A, B from the top-r SVD of W; W keeps the rest).
    """

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: Union[List[str], str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    layers_to_transform: Optional[List[int]] = None
    bias: str = "none"
    modules_to_save: Optional[List[str]] = None
    use_rslora: bool = False
    use_dora: bool = False
    init: str = "default"

    def __post_init__(self) -> None:
        if not _is_int(self.r) or self.r <= 0:
            raise ValueError(f"LoraConfig.r must be a positive integer, got {self.r!r}")
        for name in ("lora_alpha", "lora_dropout"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise ValueError(f"LoraConfig.{name} must be a finite number, got {value!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraConfig.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        for name in ("use_rslora", "use_dora"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LoraConfig.{name} must be true or false, got {getattr(self, name)!r}")
        if self.bias not in BIAS_MODES:
            raise ValueError(f"LoraConfig.bias must be one of {BIAS_MODES}, got {self.bias!r}")
        if self.init not in INIT_MODES:
            raise ValueError(f"LoraConfig.init must be one of {INIT_MODES}, got {self.init!r}")
        if self.target_modules == ALL_LINEAR:
            pass
        elif isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as e:
                raise ValueError(f"LoraConfig.target_modules: invalid regex "
                                 f"{self.target_modules!r} ({e})") from None
        elif not isinstance(self.target_modules, (list, tuple)) or not all(
                isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(f"LoraConfig.target_modules must be a regex or a list of module names, "
                             f"got {self.target_modules!r}")
        elif not self.target_modules:
            raise ValueError("LoraConfig.target_modules is empty")
        else:
            self.target_modules = list(self.target_modules)
        if _is_int(self.layers_to_transform):
            self.layers_to_transform = [self.layers_to_transform]
        if self.layers_to_transform is not None and not (
                isinstance(self.layers_to_transform, (list, tuple))
                and all(_is_int(i) and i >= 0 for i in self.layers_to_transform)):
            raise ValueError(f"LoraConfig.layers_to_transform must be layer indices (integers >= 0), "
                             f"got {self.layers_to_transform!r}")
        if self.modules_to_save is not None and not (
                isinstance(self.modules_to_save, (list, tuple)) and all(isinstance(m, str) for m in self.modules_to_save)):
            raise ValueError(f"LoraConfig.modules_to_save must be a list of module names, got {self.modules_to_save!r}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def matches(self, path: str) -> bool:
        """Whether the module at ``path`` gets LoRA (PEFT's matching rules; "all-linear": any
        module but the output head, ``is_target`` keeping it to linear layers)."""
        if self.target_modules == ALL_LINEAR:
            hit = path.rsplit(".", 1)[-1] != "lm_head"
        elif isinstance(self.target_modules, str):
            hit = re.fullmatch(self.target_modules, path) is not None
        else:
            hit = any(path == t or path.endswith("." + t) for t in self.target_modules)
        if hit and self.layers_to_transform is not None:
            m = _LAYER_INDEX.search(path)
            hit = m is not None and int(m.group(1)) in self.layers_to_transform
        return hit

    # ------------------------------------------------------------------ PEFT interop
    def to_peft(self) -> dict:
        """``adapter_config.json`` content that PEFT loads unchanged."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
            "inference_mode": True, "r": self.r, "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout, "target_modules": self.target_modules,
            "layers_to_transform": self.layers_to_transform, "bias": self.bias,
            "modules_to_save": self.modules_to_save, "use_rslora": self.use_rslora,
            "use_dora": self.use_dora, "fan_in_fan_out": False, "lora_bias": False,
            "init_lora_weights": {"default": True}.get(self.init, self.init),
            "rank_pattern": {}, "alpha_pattern": {},
        }

    @classmethod
    def from_peft(cls, cfg: dict, source: str = "<dict>") -> "LoraConfig":
        """Read a PEFT ``adapter_config.json`` dict; unsupported features raise naming the key."""
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: an adapter config is a JSON object, got {type(cfg).__name__}")
        if cfg.get("target_modules") is None:
            raise ValueError(f"{source}: target_modules is missing")
        # Keys of a newer PEFT are ignored. The file's weights replace any initialisation, and
        # PiSSA's would also rewrite the base weights: a loaded adapter never re-initialises.
        known = {f.name for f in dataclasses.fields(cls)} | set(PEFT_ARGUMENTS)
        args = {k: v for k, v in cfg.items() if k in known and k not in ("init", "init_lora_weights")}
        try:
            return cls(**{"lora_alpha": 8, **args}, init="gaussian" if cfg.get("init_lora_weights") == "gaussian"
                       else "default")
        except ValueError as e:
            raise ValueError(f"{source}: {str(e).removeprefix('LoraConfig: ')}") from None


def _a_init(config: LoraConfig):
    """A's initialiser: N(0, 1/r) for "gaussian", else kaiming-uniform(a=√5), U(±1/√in) (PEFT's default)."""
    return Normal(1.0 / config.r) if config.init == "gaussian" else HeUniform(negative_slope=math.sqrt(5))


def _dropout(x, rate: float, training: bool):
    """LoRA's input dropout as a drawn mask: nn.Dropout's (output, mask) tuple breaks the
    graph-mode gradient of the whole model ("func graph is empty: zeros_like", MindSpore 2.10)."""
    if rate > 0 and training:
        keep = ops.stop_gradient(ops.rand_like(x, dtype=ms.float32) >= rate)
        return x * keep.astype(x.dtype) / (1.0 - rate)
    return x


class LoraAdapter(nn.Cell):
    """What every LoRA layer shares: the base weight it owns, the adapter pair A and B, the
    scaling s, the input dropout, and folding ΔW = s·B·A into the base weight and back.

    The parameters are named ``<path>.lora_a`` / ``<path>.lora_b`` (PEFT's ``lora_A`` /
    ``lora_B``); a subclass gives A's initial value and B's shape (stacked for experts) and
    the forward. ``merge`` / ``unmerge`` are exact in float64 and round once to the weight's
    dtype; a subclass that merges more than ΔW (DoRA) says how in ``_fold_np`` / ``_unfold_np``.

    Attributes:
        scaling: s = alpha/r (rsLoRA: alpha/√r).
        merged: whether ΔW is in ``weight`` (the forward then skips the adapter).
        dropout: the rate of the dropout on the adapter's input while training.
        compute_dtype: the dtype the matmuls run in (None: the input's), as ``Linear``'s.
    """

    def __init__(self, base: nn.Cell, bias: Optional[Parameter], config: LoraConfig, path: str,
                 lora_a: Tensor, lora_b_shape: tuple):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, bias  # the base's own Parameters: keys and storage kept
        self.scaling = config.scaling
        self.merged = False
        # Adapter weights stay fp32 over a fp16/bf16 base (as PEFT's autocast_adapter_dtype):
        # AdamW updates of ~1e-4·|w| vanish in 8 mantissa bits.
        self.lora_a = Parameter(lora_a, name=f"{path}.lora_a")
        self.lora_b = Parameter(initializer("zeros", lora_b_shape, ms.float32), name=f"{path}.lora_b")
        self.dropout = float(config.lora_dropout)
        self.matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = base.compute_dtype

    def apply_options(self, options: ExecutionOptions) -> None:
        self.compute_dtype = low_dtype(options.compute_dtype)

    @property
    def use_dora(self) -> bool:
        """Whether this is a DoRA layer (``DoRALayer``); read-only: the class decides."""
        return False

    def adapter_arrays(self) -> Dict[str, np.ndarray]:
        """The adapter's tensors as a PEFT adapter file holds them, by mindqwen parameter name."""
        return {self.lora_a.name: self.lora_a.asnumpy(), self.lora_b.name: self.lora_b.asnumpy()}

    # ------------------------------------------------------------------ host-side merge
    def delta_np(self) -> np.ndarray:
        """ΔW = s·B·A in float64: [out, in], or [E, out, in] per expert (matmul maps over E)."""
        return self.scaling * np.matmul(self.lora_b.asnumpy().astype(np.float64),
                                        self.lora_a.asnumpy().astype(np.float64))

    def merged_weight_np(self) -> np.ndarray:
        """The weight ``merge`` would write, in float64, without touching the layer."""
        return self._weight_np() if self.merged else self._fold_np(self._adapted_np())

    def merge(self) -> None:
        """W ← W + ΔW (computed in float64); a no-op when merged."""
        if not self.merged:
            self._set_weight_np(self.merged_weight_np())
            self.merged = True

    def unmerge(self) -> None:
        """Undo ``merge`` (to the weight dtype's rounding); a no-op when not merged."""
        if self.merged:
            self._set_weight_np(self._unfold_np(self._weight_np()) - self.delta_np())
            self.merged = False

    def _fold_np(self, w: np.ndarray) -> np.ndarray:
        """W + ΔW → the merged weight (plain LoRA: itself). Must not change the layer."""
        return w

    def _unfold_np(self, w: np.ndarray) -> np.ndarray:
        """The merged weight → W + ΔW: ``_fold_np`` undone (plain LoRA: itself)."""
        return w

    def _weight_np(self) -> np.ndarray:
        return self.weight.asnumpy().astype(np.float64)

    def _adapted_np(self) -> np.ndarray:
        """W + ΔW in float64 (the adapted weight while not merged)."""
        return self._weight_np() + self.delta_np()

    def _set_weight_np(self, w: np.ndarray) -> None:
        # Through float32 as the weights were always written, then to the base's dtype.
        self.weight.set_data(Tensor(w.astype(np.float32)).astype(self.weight.dtype))


class LoRALayer(LoraAdapter):
    """A ``Linear`` plus a low-rank update; owns the base ``weight`` and ``bias``.

        y = x·Wᵀ + b + s·(drop(x)·Aᵀ)·Bᵀ                       s = alpha/r (rsLoRA: alpha/√r)

    x·Aᵀ is computed first, so the update costs O(T·r·(in + out)), never an [out, in] matrix.
    With ``init="pissa"`` A and B start from W's top-r SVD and W keeps the residual;
    ``pissa_init`` then holds the initial A and B (None otherwise).
    """

    def __init__(self, base: Linear, config: LoraConfig, path: str):
        if config.use_dora != self.use_dora:  # the class decides DoRA: a mismatch would save a wrong adapter
            raise ValueError(f"{path}: LoraConfig.use_dora={config.use_dora} takes "
                             f"{'DoRALayer' if config.use_dora else 'LoRALayer'}, not {type(self).__name__} "
                             "(inject_lora picks the class from the config)")
        a = initializer(_a_init(config), (config.r, base.in_features), ms.float32)
        super().__init__(base, base.bias, config, path, a, (base.out_features, config.r))
        self.pissa_init = self._init_pissa() if config.init == "pissa" else None

    def weights(self) -> tuple:
        """weight, bias (if any), then the adapter's weights (``_adapter_weights``)."""
        base = (self.weight,) if self.bias is None else (self.weight, self.bias)
        return base + self._adapter_weights()

    def construct(self, x):
        return self.apply(self.weights(), x)

    def apply(self, w, x):
        """x (..., in) with ``weights()`` w → (..., out)."""
        n = 1 if self.bias is None else 2  # where the adapter's weights start in w
        x2, weight = x.reshape(-1, self.in_features), w[0]  # (T, in)
        if self.compute_dtype is not None:
            x2, weight = x2.astype(self.compute_dtype), weight.astype(self.compute_dtype)
        a, b = w[n].astype(x2.dtype), w[n + 1].astype(x2.dtype)
        y = self.matmul(x2, weight)  # (T, out)
        if not self.merged:
            xd = _dropout(x2, self.dropout, self.training)
            lora = self.matmul(self.matmul(xd, a), b) * self.scaling  # (T, r) -> (T, out)
            y = self._add_update(y, lora, xd, weight, w[0], w[n:])
        if self.bias is not None:
            y = y + w[1].astype(y.dtype)
        return y.reshape(x.shape[:-1] + (self.out_features,)).astype(x.dtype)

    # Hooks that DoRALayer overrides, so the graph-mode forward above needs no super() call.
    def _adapter_weights(self) -> tuple:
        """The adapter's part of ``weights()``: lora_a, lora_b."""
        return self.lora_a, self.lora_b

    def _add_update(self, y, lora, xd, weight, w0, adapter):
        """y (T, out) = x·Wᵀ plus the update ``lora`` = s·(xd·Aᵀ)·Bᵀ; xd is the dropped input,
        ``weight`` W in the compute dtype, w0 W as stored, ``adapter`` this layer's part of w."""
        return y + lora

    def adapter_arrays(self) -> Dict[str, np.ndarray]:
        """As the base's; a PiSSA adapter is exported as PEFT does it: rank 2r relative to the
        *original* weight ([A; A0], [B, −B0]), so it applies to the untouched base checkpoint."""
        arrays = super().adapter_arrays()
        if self.pissa_init is not None:
            a, b = self.lora_a.name, self.lora_b.name
            arrays[a] = np.concatenate([arrays[a], self.pissa_init["lora_a"]], 0)
            arrays[b] = np.concatenate([arrays[b], -self.pissa_init["lora_b"]], 1)
        return arrays

    def _init_pissa(self) -> Dict[str, np.ndarray]:
        """A, B from the top-r singular triplets of W (scaled so s·B·A is their sum); W keeps
        the residual. Returns the initial A, B, needed to export a PEFT-compatible adapter."""
        w = self._weight_np()
        u, sv, vt = np.linalg.svd(w, full_matrices=False)
        r = self.lora_a.shape[0]
        root = np.sqrt(sv[:r] / self.scaling)
        a, b = root[:, None] * vt[:r], u[:, :r] * root[None, :]
        self.lora_a.set_data(Tensor(a.astype(np.float32)))
        self.lora_b.set_data(Tensor(b.astype(np.float32)))
        self._set_weight_np(w - self.scaling * b @ a)
        return {"lora_a": self.lora_a.asnumpy().copy(), "lora_b": self.lora_b.asnumpy().copy()}


class DoRALayer(LoRALayer):
    """Weight-decomposed LoRA: a trainable magnitude ``lora_magnitude_vector`` m per output row
    rescales the adapted weight's rows to norm m.

        y = m/‖W + s·B·A‖ ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ) + b      (row norms, held constant in backward,
                                                           as PEFT does)

    m starts at the row norms of W + s·B·A (after PiSSA's initialisation, when asked), so the
    layer starts as a LoRA layer would.
    """

    def __init__(self, base: Linear, config: LoraConfig, path: str):
        super().__init__(base, config, path)
        norms = self._row_norms_np(self._adapted_np()).astype(np.float32)
        self.lora_magnitude_vector = Parameter(Tensor(norms), name=f"{path}.lora_magnitude_vector")
        # m/‖W + ΔW‖ per row, as merge computed it: unmerge divides by it (None while not merged).
        self._dora_factor: Optional[np.ndarray] = None

    @property
    def use_dora(self) -> bool:
        """True: this is a DoRA layer."""
        return True

    def _adapter_weights(self) -> tuple:
        """lora_a, lora_b, lora_magnitude_vector."""
        return self.lora_a, self.lora_b, self.lora_magnitude_vector

    def _add_update(self, y, lora, xd, weight, w0, adapter):
        """y + (m/‖W + s·B·A‖ − 1)·(xd·Wᵀ) + m/‖W + s·B·A‖·lora; with no dropout xd·Wᵀ is y itself."""
        a, b, m = adapter
        wd = w0.astype(ms.float32) + self.matmul(b, a.T) * self.scaling  # (out, in)
        norm = ops.stop_gradient(ops.sqrt(ops.reduce_sum(wd * wd, 1)))  # (out,)
        scale = (m / norm).astype(y.dtype)
        yd = y if self.dropout == 0 else self.matmul(xd, weight)
        return y + (scale - 1) * yd + scale * lora

    def adapter_arrays(self) -> Dict[str, np.ndarray]:
        """As ``LoRALayer``'s, plus the magnitude vector."""
        arrays = super().adapter_arrays()
        arrays[self.lora_magnitude_vector.name] = self.lora_magnitude_vector.asnumpy()
        return arrays

    def merge(self) -> None:
        """W ← m/‖W + s·B·A‖ ⊙ (W + s·B·A), computed in float64; keeps the factor for ``unmerge``."""
        if not self.merged:
            self._dora_factor = self._factor_np(self._adapted_np())
            super().merge()

    def _fold_np(self, w: np.ndarray) -> np.ndarray:
        """W + ΔW → its rows rescaled to the magnitudes m."""
        return w * self._factor_np(w)[:, None]

    def _unfold_np(self, w: np.ndarray) -> np.ndarray:
        # The factor merge used, not one recomputed from the merged (rounded) weight.
        return w / self._dora_factor[:, None]

    def _factor_np(self, w: np.ndarray) -> np.ndarray:
        """m/‖row‖ for each row of w (W + ΔW), in float64."""
        return self.lora_magnitude_vector.asnumpy().astype(np.float64) / self._row_norms_np(w)

    @staticmethod
    def _row_norms_np(w: np.ndarray) -> np.ndarray:
        return np.sqrt((w * w).sum(1))


class ExpertLoRALayer(LoraAdapter):
    """LoRA on an ``ExpertLinear`` (one projection of all E experts, stacked): expert e gets its
    own A[e] [r, in] and B[e] [out, r], PEFT's ``mlp.experts.{e}.<proj>.lora_A/B`` on HF's
    per-expert modules. Owns the base [E, out, in] ``weight``; has no bias.

        y[e] = x[e]·W[e]ᵀ + s·(drop(x[e])·A[e]ᵀ)·B[e]ᵀ          x (E, T, in) → y (E, T, out)

    ``fan_out`` / ``fan_in`` are ``ExpertLinear``'s (every expert on every token), adapters added.
    """

    def __init__(self, base: ExpertLinear, config: LoraConfig, path: str):
        if config.use_dora or config.init == "pissa":
            raise ValueError(f"{path}: {'DoRA' if config.use_dora else 'PiSSA'} on a mixture of experts' "
                             "experts is not implemented; leave gate_proj/up_proj/down_proj out of target_modules "
                             "or use plain LoRA")
        e, r = base.num_experts, config.r
        # Initialised as E separate [r, in] matrices: kaiming-uniform's bound is 1/√in per expert.
        a = initializer(_a_init(config), (e * r, base.in_features), ms.float32).init_data()
        super().__init__(base, None, config, path, a.reshape(e, r, base.in_features), (e, base.out_features, r))
        self.num_experts = e
        self.bmm = ops.BatchMatMul(transpose_b=True)

    def construct(self, x):
        """x (E, T, in) → (E, T, out): expert e's tokens through expert e's weight and adapter."""
        x3, w, a, b = self._cast(x)
        y = self.bmm(x3, w)  # (E, T, out)
        if not self.merged:
            y = y + self.bmm(self.bmm(_dropout(x3, self.dropout, self.training), a), b) * self.scaling  # (E, T, r) -> (E, T, out)
        return y.astype(x.dtype)

    def fan_out(self, x2):
        """x2 (N, in) → (N, E, out): every expert, with its adapter, on every token."""
        n, e, r = x2.shape[0], self.num_experts, self.lora_a.shape[1]
        x2c, w, a, b = self._cast(x2)
        y = self.matmul(x2c, w.reshape(-1, self.in_features)).reshape(n, e, self.out_features)
        if not self.merged:
            xa = self.matmul(_dropout(x2c, self.dropout, self.training), a.reshape(-1, self.in_features)).reshape(n, e, r)  # (N, E, r)
            y = y + self.bmm(xa.transpose(1, 0, 2), b).transpose(1, 0, 2) * self.scaling  # (N, E, out)
        return y.astype(x2.dtype)

    def fan_in(self, h):
        """h (N, E, in) → Σ_e (h[:, e]·W[e]ᵀ + s·h[:, e]·A[e]ᵀ·B[e]ᵀ) (N, out)."""
        n = h.shape[0]
        hc, w, a, b = self._cast(h)
        y = self.matmul(hc.reshape(n, -1), w.transpose(1, 0, 2).reshape(self.out_features, -1))
        if not self.merged:
            ha = self.bmm(_dropout(hc, self.dropout, self.training).transpose(1, 0, 2), a).transpose(1, 0, 2)  # (N, E, r)
            y = y + self.matmul(ha.reshape(n, -1), b.transpose(1, 0, 2).reshape(self.out_features, -1)) * self.scaling
        return y.astype(h.dtype)

    def _cast(self, x):
        w = self.weight
        if self.compute_dtype is not None:
            x, w = x.astype(self.compute_dtype), w.astype(self.compute_dtype)
        return x, w, self.lora_a.astype(x.dtype), self.lora_b.astype(x.dtype)


# ---------------------------------------------------------------------- model surgery
def lora_layers(model: nn.Cell) -> Dict[str, LoraAdapter]:
    """Module path → LoRA layer (``LoRALayer``, ``DoRALayer`` or ``ExpertLoRALayer``), in model order."""
    return {path: cell for path, cell in model.cells_and_names() if isinstance(cell, LoraAdapter)}


def apply_lora(model: nn.Cell, config: Optional[LoraConfig] = None) -> nn.Cell:
    """Replace every ``Linear`` that ``config`` targets by a ``LoRALayer``, then freeze the rest.

    The original ``weight``/``bias`` Parameters are reused, so base keys are unchanged.

    Raises:
        ValueError: if the model already has LoRA, or no module matches the targets.
    """
    config = fused_qkv_targets(config or LoraConfig(), model)
    if lora_layers(model):
        raise ValueError("the model already has LoRA layers; merge_and_unload() it first")
    _check_modules_to_save(model, config.modules_to_save)
    inject_lora(model, config)
    model.lora_config = config
    mark_only_lora_trainable(model)
    invalidate_compiled_graphs(model)
    return model


FUSED_QKV = ("query_key_value", "c_attn")  # the original Qwen's fused q/k/v, as its guides name it


def fused_qkv_targets(config: LoraConfig, model: nn.Cell) -> LoraConfig:
    """``query_key_value`` / ``c_attn`` in the targets of an original-Qwen model stand for q_proj,
    k_proj and v_proj (held apart here: each gets its own A and B); elsewhere they are an error."""
    targets = config.target_modules
    if isinstance(targets, str) or not any(t in FUSED_QKV for t in targets):
        return config
    if getattr(getattr(model, "config", None), "model_type", None) != "qwen":
        raise ValueError(f"target_modules {[t for t in targets if t in FUSED_QKV]} name the original Qwen's fused "
                         "q/k/v projection (QWenLMHeadModel); this model has q_proj, k_proj, v_proj")
    split = [t for t in targets if t not in FUSED_QKV] + ["q_proj", "k_proj", "v_proj"]
    return dataclasses.replace(config, target_modules=list(dict.fromkeys(split)))


def inject_lora(root: nn.Cell, config: LoraConfig, prefix: str = "") -> List[str]:
    """Replace every ``Linear`` under ``root`` that ``config`` targets by a ``LoRALayer``
    (``DoRALayer`` with ``use_dora``; ``ExpertLoRALayer`` for an ``ExpertLinear``; trainability
    is left to the caller); returns the replaced paths.

    ``prefix`` is prepended to the module paths that name the LoRA parameters, for a ``root``
    that lives inside a larger model (``vision.`` …).
    """
    routers = [path for path, cell in root.cells_and_names() if isinstance(cell, Router)
               and config.target_modules != ALL_LINEAR and config.matches(path)]
    if routers:  # a low-rank router changes which experts tokens pick; PEFT users train it in full
        raise ValueError(f"LoraConfig.target_modules matches the expert router {routers[0]}, which takes no "
                         "LoRA: leave it frozen (the default) or train it in full with modules_to_save=['gate']")
    linears = [(path, cell) for path, cell in root.cells_and_names() if isinstance(cell, (Linear, ExpertLinear))]
    targets = [(path, cell) for path, cell in linears if is_target(config, path, cell)]
    if not targets:
        names = sorted({p.rsplit(".", 1)[-1] for p, _ in linears})
        raise ValueError(f"LoraConfig.target_modules={config.target_modules!r} matches no module "
                         f"(layers_to_transform={config.layers_to_transform}); linear modules are: "
                         f"{', '.join(names)}")
    cells = dict(root.cells_and_names())
    for path, base in targets:
        parent, _, child = path.rpartition(".")
        layer = ExpertLoRALayer if isinstance(base, ExpertLinear) else DoRALayer if config.use_dora else LoRALayer
        cells[parent].insert_child_to_cell(child, layer(base, config, prefix + path))
    return [path for path, _ in targets]


def is_target(config: LoraConfig, path: str, cell: nn.Cell) -> bool:
    """Whether ``config`` adapts the module at ``path``; stacked experts are matched as PEFT
    matches HF's modules, one per expert (``…mlp.experts.{e}.up_proj``), all or none."""
    if not isinstance(cell, ExpertLinear):
        return config.matches(path)
    if config.target_modules == ALL_LINEAR:
        return False
    hits = [config.matches(name) for name in per_expert_names(path, cell.num_experts)]
    if any(hits) and not all(hits):
        raise ValueError(f"LoraConfig.target_modules={config.target_modules!r} adapts {sum(hits)} of the "
                         f"{len(hits)} experts at {path}; mindqwen stacks a layer's experts, so LoRA adapts "
                         "all of them or none")
    return all(hits)


def mark_only_lora_trainable(model: nn.Cell) -> None:
    """The one place that decides trainability: LoRA A/B/magnitude, biases per ``bias``,
    and every parameter of ``modules_to_save``; everything else is frozen."""
    config: LoraConfig = model.lora_config
    layers = lora_layers(model)
    saved = tuple(f"{m}." for m in _module_paths(model, config.modules_to_save))
    for p in model.get_parameters():
        owner = p.name.rpartition(".")[0]
        is_bias = p.name.endswith(".bias")
        p.requires_grad = bool(
            p.name.endswith((".lora_a", ".lora_b", ".lora_magnitude_vector"))
            or (is_bias and config.bias == "all")
            or (is_bias and config.bias == "lora_only" and owner in layers)
            or p.name.startswith(saved))


def trainable_report(model: nn.Cell) -> str:
    """``trainable params: X || all params: Y || trainable%: Z`` (PEFT's wording)."""
    params = model.get_parameters()
    total = sum(int(np.prod(p.shape)) for p in params)
    trainable = sum(int(np.prod(p.shape)) for p in model.get_parameters() if p.requires_grad)
    return f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"


def merge_lora(model: nn.Cell) -> None:
    """Fold every LoRA update into its base weight (the LoRA branch is then skipped)."""
    for layer in lora_layers(model).values():
        layer.merge()
    invalidate_compiled_graphs(model)


def unmerge_lora(model: nn.Cell) -> None:
    """Undo ``merge_lora``."""
    for layer in lora_layers(model).values():
        layer.unmerge()
    invalidate_compiled_graphs(model)


def merge_and_unload(model: nn.Cell) -> nn.Cell:
    """Merge, then put plain ``Linear`` layers back: the model is a base model again."""
    merge_lora(model)
    cells = dict(model.cells_and_names())
    for path, layer in lora_layers(model).items():
        if isinstance(layer, ExpertLoRALayer):
            plain = ExpertLinear(layer.num_experts, layer.in_features, layer.out_features)
            plain.weight = layer.weight
        else:
            plain = Linear(layer.in_features, layer.out_features, layer.bias is not None)
            plain.weight, plain.bias = layer.weight, layer.bias  # merged Parameters, same names
        plain.compute_dtype = layer.compute_dtype
        parent, _, child = path.rpartition(".")
        cells[parent].insert_child_to_cell(child, plain)
    for p in model.get_parameters():
        p.requires_grad = True
    if hasattr(model, "lora_config"):
        del model.lora_config
    invalidate_compiled_graphs(model)
    return model


def _module_paths(model: nn.Cell, names: Optional[Sequence[str]]) -> List[str]:
    if not names:
        return []
    paths = [path for path, _ in model.cells_and_names() if path]
    return [p for p in paths if any(p == n or p.endswith("." + n) for n in names)]


def _check_modules_to_save(model: nn.Cell, names: Optional[Sequence[str]]) -> None:
    for n in names or []:
        if not _module_paths(model, [n]):
            raise ValueError(f"LoraConfig.modules_to_save: no module named {n!r} in the model")


# ---------------------------------------------------------------------- PEFT adapter files
def adapter_state(model: nn.Cell) -> Dict[str, np.ndarray]:
    """The adapter's tensors under PEFT's key names (``base_model.model.<path>.lora_A.weight`` …);
    stacked experts' tensors split into PEFT's per-expert ones (``…mlp.experts.3.up_proj.lora_A.weight``).

    Each layer gives its own tensors (``adapter_arrays``: a PiSSA adapter as PEFT exports it, a
    rank-2r LoRA relative to the *original* weights; DoRA's magnitudes too).
    """
    config: LoraConfig = model.lora_config
    named: Dict[str, np.ndarray] = {}  # mindqwen name → array
    layers = lora_layers(model)
    for layer in layers.values():
        named.update(layer.adapter_arrays())
    for p in model.get_parameters():
        owner = p.name.rpartition(".")[0]
        if p.requires_grad and p.name.endswith(".bias") and (config.bias == "all" or owner in layers):
            named[p.name] = p.asnumpy()
    for path in _module_paths(model, config.modules_to_save):
        for p in model.get_parameters():
            if p.name.startswith(path + "."):
                named[p.name] = p.asnumpy()
    out = {}
    for name, array in named.items():
        if is_stacked(name):
            out.update({_peft_key(n): array[e] for e, n in enumerate(per_expert_names(name, array.shape[0]))})
        else:
            out[_peft_key(name)] = array
    return out


def save_adapter(model: nn.Cell, folder: str) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's format."""
    config: LoraConfig = getattr(model, "lora_config", None)
    if config is None:
        raise ValueError("the model has no LoRA adapter (apply_lora or load_adapter first)")
    fused = [path for path in lora_layers(model) if getattr(model, "config", None) is not None
             and model.config.model_type == "qwen3_next" and ".linear_attn.in_proj_" in path]
    if fused:  # its checkpoints fuse these four into in_proj_qkvz / in_proj_ba, which PEFT's keys name
        raise ValueError(f"{fused[0]}: a Qwen3-Next adapter on the linear-attention input projections has no PEFT "
                         "layout yet (the checkpoint fuses them into in_proj_qkvz and in_proj_ba); "
                         "merge_and_unload(model).save_pretrained(folder) writes the merged weights")
    peft = config.to_peft()
    if config.init == "pissa":  # exported relative to the original base: rank 2r, same scaling
        peft.update(r=2 * config.r, init_lora_weights=True,
                    lora_alpha=config.lora_alpha * (math.sqrt(2) if config.use_rslora else 2))
    with staged_files(folder) as (stage, names):
        save_file(adapter_state(model), os.path.join(stage, ADAPTER_WEIGHTS))
        with open(os.path.join(stage, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(peft, f, indent=2)
        names += [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def load_adapter(model: nn.Cell, folder: str, allow_non_finite: bool = False) -> nn.Cell:
    """Apply LoRA as ``folder/adapter_config.json`` says, then load its weights (PEFT format).

    The user's files are only read. Raises naming the file and key on any mismatch, and on a
    tensor holding NaN or inf unless ``allow_non_finite`` (the tensors are read and checked
    before the model is touched).
    """
    cfg_path, w_path = os.path.join(folder, ADAPTER_CONFIG), os.path.join(folder, ADAPTER_WEIGHTS)
    config = LoraConfig.from_peft(read_json(cfg_path, CheckpointError, "adapter config"), cfg_path)
    weights = SafetensorsFile(w_path, allow_non_finite)
    foreign = [k for k in weights.keys() if not k.startswith(PEFT_PREFIX)]
    if foreign:
        raise CheckpointError(f"{w_path}: tensor {foreign[0]} does not start with {PEFT_PREFIX!r} "
                              "(not a PEFT adapter)")
    ranks = {weights.shape(k)[0] for k in weights.keys() if k.endswith(".lora_A.weight")}
    if ranks - {config.r}:
        raise CheckpointError(f"{w_path}: lora_A tensors have rank {sorted(ranks - {config.r})[0]}, "
                              f"{cfg_path} says r={config.r}")
    arrays = {key: weights.get(key) for key in sorted(weights.keys())}
    apply_lora(model, config)
    params = {p.name: p for p in model.get_parameters()}
    wanted = {_peft_key(n) for name, p in params.items() if name.endswith((".lora_a", ".lora_b", ".lora_magnitude_vector"))
              for n in (per_expert_names(name, p.shape[0]) if is_stacked(name) else [name])}
    missing = sorted(wanted - set(weights.keys()))
    if missing:
        raise CheckpointError(f"{w_path}: missing adapter tensors {', '.join(missing[:6])}")
    named = {key[len(PEFT_PREFIX):].replace(".lora_A.weight", ".lora_a").replace(".lora_B.weight", ".lora_b"): (key, a)
             for key, a in arrays.items()}
    named.update(_stack_experts(named, w_path))
    for name, (key, array) in named.items():
        if name not in params:
            raise CheckpointError(f"{w_path}: tensor {key} targets {name}, which the model does not have")
        p = params[name]
        if tuple(array.shape) != tuple(p.shape):
            raise CheckpointError(f"{w_path}: tensor {key} has shape {list(array.shape)}, "
                                  f"the model expects {list(p.shape)}")
        p.set_data(Tensor(array).astype(p.dtype))
    invalidate_compiled_graphs(model)
    return model


def _stack_experts(named: Dict[str, tuple], source: str) -> Dict[str, tuple]:
    """Pop the per-expert tensors of ``named`` (name → (file key, array)); return them stacked
    under the model's names, keyed by a description of their file keys."""
    groups: Dict[str, Dict[int, tuple]] = {}
    for name in [n for n in named if expert_slice(n)]:
        stacked, e = expert_slice(name)
        groups.setdefault(stacked, {})[e] = named.pop(name)
    out = {}
    for name, parts in groups.items():
        key = re.sub(r"\.experts\.\d+\.", ".experts.<e>.", parts[min(parts)][0])
        if sorted(parts) != list(range(len(parts))):
            raise CheckpointError(f"{source}: {key}: experts {sorted(set(range(max(parts) + 1)) - set(parts))} "
                                  "are missing")
        out[name] = (key, np.stack([parts[e][1] for e in range(len(parts))]))
    return out


def _peft_key(name: str) -> str:
    """mindqwen parameter name → PEFT key (``…q_proj.lora_a`` → ``base_model.model.…lora_A.weight``)."""
    return PEFT_PREFIX + re.sub(r"\.lora_([ab])$", lambda m: f".lora_{m.group(1).upper()}.weight", name)


__all__ = ["LoraConfig", "LoraAdapter", "LoRALayer", "DoRALayer", "ExpertLoRALayer", "apply_lora",
           "mark_only_lora_trainable", "trainable_report",
           "merge_lora", "unmerge_lora", "merge_and_unload", "save_adapter", "load_adapter",
           "adapter_state", "lora_layers"]
