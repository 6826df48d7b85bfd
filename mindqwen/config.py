"""QwenConfig: the shape and numerics of a Qwen2 / Qwen2.5 / Qwen3 / Qwen3.5 decoder, dense or mixture-of-experts.

Lenient with HF ``config.json`` (unknown keys are ignored, both rope-theta spellings are read),
strict with values: inconsistent shapes raise ``ConfigError`` naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

import numpy as np

from mindqwen.io.jsonfile import read_json

# HF architecture name -> mindqwen model_type. Qwen2.5 uses the Qwen2 architecture. Qwen3.5 is published
# as a vision-language checkpoint whose language model is the text model; the text architecture comes
# last, so it is the one written back (``to_hf``).
ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "QWenLMHeadModel": "qwen",
                 "Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5ForCausalLM": "qwen3_5",
                 "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe", "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
                 "Qwen3NextForCausalLM": "qwen3_next"}
# HF model_type (config.json) -> mindqwen model_type, where they differ.
HF_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
# Hybrid decoders: Gated DeltaNet linear-attention layers between full-attention layers whose output is
# gated (q_proj gives query and gate), with zero-centred RMSNorm weights (x̂ · (1 + w)).
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MOE_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_5_moe", "qwen3_next")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
# Keys each scaled rope type needs beside rope_type (yarn's factor may come from the two lengths).
ROPE_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
# The loss holds one (rows, vocab) fp32 block of logits at a time, of at most 2^25 elements
# (128 MB): 220 rows at Qwen's 151,936-token vocabulary, where one 512-token row is 311 MB.
LOSS_CHUNK_ELEMENTS = 1 << 25
# The label of a position that is not scored (PyTorch's and HF's ignore_index): the data writes
# it for prompts and padding, and every loss and log-prob skips it.
IGNORE_INDEX = -100


class ConfigError(ValueError):
    """An invalid or unsupported model configuration."""


@dataclass
class QwenConfig:
    """Hyper-parameters of a Qwen causal LM. Defaults are Qwen2.5-0.5B.

    Attributes:
        model_type: "qwen2" (Qwen2, Qwen2.5), "qwen3", their mixtures of experts "qwen2_moe"
            (Qwen1.5-MoE, Qwen2-57B-A14B) and "qwen3_moe" (Qwen3-30B-A3B, Qwen3-235B-A22B), or
            "qwen": the original Qwen (Qwen-1.8B/7B/14B/72B, ``QWenLMHeadModel``), a Qwen2-style
            decoder with multi-head attention whose checkpoints keep their own layout.
        head_dim: per-head width; ``None`` means ``hidden_size // num_attention_heads``.
            Qwen3 sets it explicitly, so ``num_attention_heads * head_dim`` may differ from
            ``hidden_size``.
        qkv_bias: bias on q/k/v projections (Qwen2: always; Qwen3: ``attention_bias``).
        o_bias: bias on the output projection (Qwen3 ``attention_bias`` only).
        qk_norm: RMSNorm over ``head_dim`` on queries and keys before RoPE (Qwen3).
        rope_scaling: ``None`` or an HF dict with ``rope_type`` in default | linear | dynamic | yarn |
            llama3; it also sets ``context_length``, the longest sequence the model runs.
        use_sliding_window / sliding_window / max_window_layers / layer_types: HF semantics; layers
            whose type is "sliding_attention" let a query at position q see keys k with
            ``q - sliding_window < k <= q``.
        num_experts / num_experts_per_tok / moe_intermediate_size: the routed SwiGLU experts of a
            mixture-of-experts layer, the k each token goes to, and their width (0 experts: dense).
        shared_expert_intermediate_size: Qwen2-MoE's always-on expert, gated by a sigmoid (0: none).
        norm_topk_prob: renormalise the k routing weights of a token to sum to 1.
        decoder_sparse_step / mlp_only_layers: layer i is a mixture of experts when
            ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers`` (HF's rule);
            the others keep a dense MLP of ``intermediate_size``.
        router_aux_loss_coef: weight of the load-balancing loss added to the training loss.
        moe_capacity_factor: training only, not an HF key. None: every expert runs on every token,
            weighted by its routing weight (HF's result exactly, at num_experts / k times the
            expert FLOPs). A factor f: expert e computes at most ceil(f · tokens · k / num_experts)
            of a batch's tokens, those that weight it most, and the assignments beyond are dropped
            (``fit`` logs their share as ``moe_dropped``). Inference is always exact.
        seq_length / use_logn_attn / use_dynamic_ntk: the original Qwen's training length and, at
            inference beyond it, its query scaling by log_seq_length(position) and its dynamic NTK
            rotary base (``modeling_qwen.py``).
        partial_rotary_factor: the share of each head's dims that rotary rotates (the first
            ``rotary_dim``); Qwen3.5: 0.25.
        full_attention_interval: hybrid models without ``layer_types``: every n-th layer is full
            attention, the others linear attention (Qwen3.5: 4).
        linear_num_key_heads / linear_num_value_heads / linear_key_head_dim / linear_value_head_dim /
            linear_conv_kernel_dim: a Gated DeltaNet layer's query/key heads, value heads (a
            multiple of the key heads), their widths, and its causal convolution's kernel.
    """

    vocab_size: int = 151936
    hidden_size: int = 896
    intermediate_size: int = 4864
    num_hidden_layers: int = 24
    num_attention_heads: int = 14
    num_key_value_heads: int = 2
    head_dim: Optional[int] = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    model_type: str = "qwen2"
    qkv_bias: bool = True
    o_bias: bool = False
    qk_norm: bool = False
    use_sliding_window: bool = False
    sliding_window: Optional[int] = None
    max_window_layers: int = 28
    layer_types: Optional[List[str]] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[int] = None
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    moe_capacity_factor: Optional[float] = None
    seq_length: Optional[int] = None
    use_logn_attn: bool = False
    use_dynamic_ntk: bool = False
    partial_rotary_factor: float = 1.0
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    # Derived in __post_init__ (not constructor arguments).
    n_rep: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.model_type not in ARCHITECTURES.values():
            raise ConfigError(f"model_type must be one of {sorted(set(ARCHITECTURES.values()))}, "
                              f"got {self.model_type!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly or fix the head count")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even integer (RoPE rotates pairs), "
                              f"got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} must divide num_attention_heads="
                f"{self.num_attention_heads} (grouped-query attention)")
        self.n_rep = self.num_attention_heads // self.num_key_value_heads
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        self._check_rope_scaling()
        self._check_sliding_window()
        self._check_linear_attention()
        self._check_experts()
        if (self.use_logn_attn or self.use_dynamic_ntk) and not (self.seq_length or 0) > 1:
            raise ConfigError(f"use_logn_attn / use_dynamic_ntk need seq_length > 1 (the training length), "
                              f"got {self.seq_length!r}")

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        rope_type = rs.get("rope_type", rs.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling.rope_type={rope_type!r} is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")
        missing = [k for k in ROPE_REQUIRED_KEYS.get(rope_type, ()) if rs.get(k) is None]
        if missing:
            raise ConfigError(f"rope_scaling with rope_type={rope_type!r} needs {', '.join(missing)}")
        needs_factor = rope_type in ("linear", "dynamic", "llama3") or (
            rope_type == "yarn" and not rs.get("original_max_position_embeddings"))
        if needs_factor and not (rs.get("factor") or 0) >= 1:
            raise ConfigError(f"rope_scaling.factor must be >= 1 for rope_type={rope_type!r}, "
                              f"got {rs.get('factor')!r}")
        if rope_type == "llama3" and not rs["high_freq_factor"] > rs["low_freq_factor"]:
            raise ConfigError(f"rope_scaling.high_freq_factor={rs['high_freq_factor']} must exceed "
                              f"low_freq_factor={rs['low_freq_factor']}")
        self.rope_scaling = {**rs, "rope_type": rope_type}

    def _check_sliding_window(self) -> None:
        if self.layer_types is None and self.is_hybrid:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0
                                else "linear_attention" for i in range(self.num_hidden_layers)]
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if self.use_sliding_window and i >= self.max_window_layers
                else "full_attention" for i in range(self.num_hidden_layers)]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries but "
                              f"num_hidden_layers={self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(f"layer_types: unsupported attention type(s) {bad}")
        if "linear_attention" in self.layer_types and not self.is_hybrid:
            raise ConfigError(f"layer_types: linear_attention layers need a hybrid model_type "
                              f"({' or '.join(HYBRID_TYPES)}), got {self.model_type!r}")
        if self.is_hybrid:
            return  # a hybrid model's layer_types are its layers, sliding window or not
        if not self.use_sliding_window:
            # HF ignores sliding fields unless use_sliding_window is true.
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        elif "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            raise ConfigError("use_sliding_window is true but sliding_window is not a positive "
                              f"integer (got {self.sliding_window!r})")

    def _check_linear_attention(self) -> None:
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ConfigError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and give an even "
                              f"rotary width (head_dim {self.head_dim} × factor = {self.rotary_dim})")
        if not self.is_hybrid:
            return
        for name in ("full_attention_interval", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer for {self.model_type}, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(f"linear_num_key_heads={self.linear_num_key_heads} must divide linear_num_value_heads="
                              f"{self.linear_num_value_heads} (each key head serves a group of value heads)")

    @property
    def is_hybrid(self) -> bool:
        """Gated DeltaNet layers beside gated full attention, zero-centred norms (Qwen3.5)."""
        return self.model_type in HYBRID_TYPES

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary rotates (``head_dim · partial_rotary_factor``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_experts(self) -> None:
        if self.model_type not in MOE_TYPES:
            if self.num_experts:
                raise ConfigError(f"num_experts={self.num_experts} needs a mixture-of-experts model_type "
                                  f"({' or '.join(MOE_TYPES)}), got {self.model_type!r}")
            if self.moe_capacity_factor is not None:
                raise ConfigError(f"moe_capacity_factor applies to a mixture of experts; {self.model_type} has none")
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer for {self.model_type}, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        if self.model_type in ("qwen2_moe", "qwen3_5_moe", "qwen3_next") and not self.shared_expert_intermediate_size > 0:
            raise ConfigError(f"{self.model_type} needs shared_expert_intermediate_size > 0 (its gated shared expert)")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer model")
        if not self.router_aux_loss_coef >= 0:
            raise ConfigError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.moe_capacity_factor is not None and not (
                isinstance(self.moe_capacity_factor, (int, float)) and not isinstance(self.moe_capacity_factor, bool)
                and self.moe_capacity_factor > 0):
            raise ConfigError(f"moe_capacity_factor must be a positive number or None (exact), "
                              f"got {self.moe_capacity_factor!r}")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` is a mixture of experts (HF's rule)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def loss_chunk_rows(self) -> int:
        """Rows of logits per block of the chunked loss (``LOSS_CHUNK_ELEMENTS``)."""
        return max(1, LOSS_CHUNK_ELEMENTS // self.vocab_size)

    def tensor_shapes(self) -> Dict[str, tuple]:
        """HF name → shape of every weight of the model this config describes: the layout of its
        HF checkpoint (``mindqwen.io.hf.model_state`` of ``QwenForCausalLM``, checked against it by
        the tests; the model itself stacks a mixture of experts' experts)."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d

        def swiglu(prefix: str, i: int) -> Dict[str, tuple]:
            return {f"{prefix}.gate_proj.weight": (i, h), f"{prefix}.up_proj.weight": (i, h),
                    f"{prefix}.down_proj.weight": (h, i)}

        shapes = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_hidden_layers):
            layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
            if self.layer_types[n] == "linear_attention":
                layer.update({f"linear_attn.{k}": v for k, v in self.linear_attention_shapes().items()})
            else:
                layer["self_attn.o_proj.weight"] = (h, q)
            if self.is_sparse(n):
                layer["mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    layer.update(swiglu(f"mlp.experts.{e}", self.moe_intermediate_size))
                if self.shared_expert_intermediate_size:
                    layer.update(swiglu("mlp.shared_expert", self.shared_expert_intermediate_size))
                    layer["mlp.shared_expert_gate.weight"] = (1, h)
            else:
                layer.update(swiglu("mlp", self.intermediate_size))
            if self.layer_types[n] != "linear_attention":
                # A hybrid model's q_proj gives each head's query and its output gate.
                for proj, rows in (("q_proj", 2 * q if self.is_hybrid else q), ("k_proj", kv), ("v_proj", kv)):
                    layer[f"self_attn.{proj}.weight"] = (rows, h)
                    if self.qkv_bias:
                        layer[f"self_attn.{proj}.bias"] = (rows,)
                if self.o_bias:
                    layer["self_attn.o_proj.bias"] = (h,)
                if self.qk_norm:
                    layer["self_attn.q_norm.weight"] = layer["self_attn.k_norm.weight"] = (d,)
            shapes.update({f"model.layers.{n}.{k}": v for k, v in layer.items()})
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def linear_attention_shapes(self) -> Dict[str, tuple]:
        """Name (under ``linear_attn.``) → shape of a Gated DeltaNet layer's weights in its checkpoint
        (Qwen3-Next fuses the input projections in two: ``mindqwen.io.linear_attention``)."""
        h, k, v = self.hidden_size, self.linear_num_key_heads * self.linear_key_head_dim, \
            self.linear_num_value_heads * self.linear_value_head_dim
        heads = self.linear_num_value_heads
        projections = ({"in_proj_qkvz.weight": (2 * k + 2 * v, h), "in_proj_ba.weight": (2 * heads, h)}
                       if self.model_type == "qwen3_next" else
                       {"in_proj_qkv.weight": (2 * k + v, h), "in_proj_z.weight": (v, h), "in_proj_b.weight": (heads, h),
                        "in_proj_a.weight": (heads, h)})
        return {**projections, "conv1d.weight": (2 * k + v, 1, self.linear_conv_kernel_dim),
                "dt_bias": (heads,), "A_log": (heads,), "norm.weight": (self.linear_value_head_dim,),
                "out_proj.weight": (h, v)}

    # ------------------------------------------------------------------ rotary positions
    @property
    def context_length(self) -> int:
        """The longest sequence (prompt and generated tokens) the model runs: ``max_position_embeddings``,
        or, with ``rope_scaling``, ``factor`` times the length it stretches when that is longer
        (``original_max_position_embeddings`` for yarn and llama3, ``max_position_embeddings`` for
        linear and dynamic). Qwen2.5 / Qwen3 with yarn, factor 4 over 32768: 131072."""
        stretched = self._stretched()
        scaled = int(self.rope_scaling["factor"] * stretched[1]) if stretched else 0
        return max(self.max_position_embeddings, scaled)

    @property
    def context_rule(self) -> str:
        """How ``context_length`` follows from the config, for messages ("max_position_embeddings",
        "rope_scaling yarn: factor 4 × original_max_position_embeddings 32768")."""
        if self.context_length == self.max_position_embeddings:
            return "max_position_embeddings"
        (name, value), rs = self._stretched(), self.rope_scaling
        return f"rope_scaling {rs['rope_type']}: factor {rs['factor']:g} × {name} {value}"

    def _stretched(self) -> Optional[tuple]:
        """(name, value) of the length ``rope_scaling.factor`` stretches; None without a factor."""
        rs = self.rope_scaling
        if not rs or rs["rope_type"] == "default" or not rs.get("factor"):
            return None
        if rs["rope_type"] in ("yarn", "llama3") and rs.get("original_max_position_embeddings"):
            return "original_max_position_embeddings", rs["original_max_position_embeddings"]
        return "max_position_embeddings", self.max_position_embeddings

    def rope_inv_freq(self) -> tuple:
        """Inverse frequencies [rotary_dim/2] (float32) and the attention scaling of the rotary table.

        Follows transformers' ``ROPE_INIT_FUNCTIONS`` in float32, as it rounds; ``dynamic``
        rescales the base at run time (see ``models/qwen.py``), so here it returns the unscaled
        frequencies.
        """
        d = self.rotary_dim
        exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        inv_freq = (1.0 / (np.float32(self.rope_theta) ** exponent)).astype(np.float32)
        rs = self.rope_scaling or {"rope_type": "default"}
        rope_type = rs["rope_type"]
        if rope_type == "linear":
            return (inv_freq / np.float32(rs["factor"])).astype(np.float32), 1.0
        if rope_type == "yarn":
            return _yarn(self, rs)
        if rope_type == "llama3":
            return _llama3(inv_freq, rs), 1.0
        return inv_freq, 1.0

    # ------------------------------------------------------------------ HF interop
    @classmethod
    def from_hf(cls, path_or_dict: Any) -> "QwenConfig":
        """Build from an HF ``config.json`` (path, folder or dict). Unknown keys are ignored.

        Reads ``rope_theta`` from the top level (transformers 4) or from
        ``rope_parameters.rope_theta`` (transformers 5). A vision-language config (Qwen3.5's
        published checkpoints) gives its ``text_config``: the language model's shape.
        """
        src = path_or_dict
        if isinstance(src, (str, os.PathLike)):
            path = os.path.join(src, "config.json") if os.path.isdir(src) else str(src)
            hf = read_json(path, ConfigError, "config file")
        else:
            path, hf = "<dict>", dict(src)
        archs = hf.get("architectures") or []
        model_type = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        hf_type = HF_MODEL_TYPES.get(hf.get("model_type"), hf.get("model_type"))
        model_type = model_type or (hf_type if hf_type in ARCHITECTURES.values() else None)
        if model_type is None:
            raise ConfigError(f"{path}: unsupported architecture {archs or hf.get('model_type')!r}; "
                              f"supported: {', '.join(ARCHITECTURES)}")
        if model_type == "qwen":
            return cls._from_qwen1(hf, path)
        if isinstance(hf.get("text_config"), dict):  # a vision-language folder: its language model
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        # Multimodal rotary sections: with text positions (equal on every axis) they are plain rotary.
        rope_params.pop("mrope_section", None), rope_params.pop("mrope_interleaved", None)
        partial_rotary = rope_params.pop("partial_rotary_factor", hf.get("partial_rotary_factor"))
        rope_scaling = hf.get("rope_scaling") or (rope_params or None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        attention_bias = bool(hf.get("attention_bias", False))
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {k: v for k, v in hf.items() if k in known}
        kwargs.update(model_type=model_type, rope_theta=float(rope_theta), rope_scaling=rope_scaling)
        if model_type in MOE_TYPES:  # transformers 5 writes Qwen3-MoE's count as num_local_experts
            kwargs["num_experts"] = hf.get("num_experts", hf.get("num_local_experts"))
            kwargs["mlp_only_layers"] = list(hf.get("mlp_only_layers") or [])
        if model_type in HYBRID_TYPES:
            kwargs["partial_rotary_factor"] = 0.25 if partial_rotary is None else float(partial_rotary)
        if model_type == "qwen3_5_moe":  # its router always renormalises the k weights; every layer is sparse
            kwargs.update(norm_topk_prob=True, decoder_sparse_step=1)
        if model_type in ("qwen3", "qwen3_moe") + HYBRID_TYPES:
            kwargs.update(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
        else:
            kwargs.update(qkv_bias=True, o_bias=False, qk_norm=False)
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def _from_qwen1(cls, hf: Dict[str, Any], path: str) -> "QwenConfig":
        """The original Qwen's config.json (``configuration_qwen.py``): its ``intermediate_size`` is
        twice the width of w1 / w2 (``ff_dim_in = intermediate_size // 2``)."""
        if hf.get("rotary_pct", 1.0) != 1.0:
            raise ConfigError(f"{path}: rotary_pct={hf['rotary_pct']}: partial rotary is not supported")
        if not hf.get("no_bias", True):
            raise ConfigError(f"{path}: no_bias=false (biases on c_proj and the MLP) is not supported")
        try:
            return cls(model_type="qwen", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                       intermediate_size=hf["intermediate_size"] // 2, num_hidden_layers=hf["num_hidden_layers"],
                       num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_attention_heads"],
                       head_dim=hf.get("kv_channels"), rms_norm_eps=hf.get("layer_norm_epsilon", 1e-6),
                       rope_theta=float(hf.get("rotary_emb_base", 10000)),
                       max_position_embeddings=hf.get("max_position_embeddings") or hf["seq_length"],
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), qkv_bias=True,
                       o_bias=False, seq_length=hf.get("seq_length"), use_logn_attn=bool(hf.get("use_logn_attn")),
                       use_dynamic_ntk=bool(hf.get("use_dynamic_ntk")))
        except KeyError as e:
            raise ConfigError(f"{path}: the original Qwen's config needs {e.args[0]!r}") from None
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> Dict[str, Any]:
        """An HF ``config.json`` dict that transformers 4 and 5 both load unchanged (for the
        original Qwen: its own config, as ``configuration_qwen.py`` reads it)."""
        if self.model_type == "qwen":
            return {"architectures": ["QWenLMHeadModel"], "model_type": "qwen", "vocab_size": self.vocab_size,
                    "hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
                    "num_attention_heads": self.num_attention_heads, "kv_channels": self.head_dim,
                    "intermediate_size": 2 * self.intermediate_size, "layer_norm_epsilon": self.rms_norm_eps,
                    "rotary_emb_base": self.rope_theta, "rotary_pct": 1.0, "seq_length": self.seq_length,
                    "max_position_embeddings": self.max_position_embeddings, "use_logn_attn": self.use_logn_attn,
                    "use_dynamic_ntk": self.use_dynamic_ntk, "no_bias": True, "scale_attn_weights": True,
                    "tie_word_embeddings": self.tie_word_embeddings, "use_cache": True}
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.model_type]
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}),
                           "rope_theta": self.rope_theta}
        hf = {
            "architectures": [arch], "model_type": self.model_type, "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 4 reads rope_theta/rope_scaling, 5 reads rope_parameters.
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": self.use_sliding_window, "sliding_window": self.sliding_window,
            "max_window_layers": self.max_window_layers, "layer_types": self.layer_types,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "attention_dropout": 0.0, "use_cache": True,
        }
        if self.model_type in ("qwen3", "qwen3_moe") + HYBRID_TYPES:
            hf.update(head_dim=self.head_dim, attention_bias=self.qkv_bias)
        if self.is_hybrid:
            hf["model_type"] = {v: k for k, v in HF_MODEL_TYPES.items()}.get(self.model_type, self.model_type)
            rope_parameters["partial_rotary_factor"] = self.partial_rotary_factor
            hf.update({name: getattr(self, name) for name in (
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim", "partial_rotary_factor")})
        if self.model_type in MOE_TYPES:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=self.mlp_only_layers,
                      router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=False)
            if self.model_type in ("qwen2_moe", "qwen3_5_moe", "qwen3_next"):
                hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return hf

    def replace(self, **overrides: Any) -> "QwenConfig":
        """A copy with ``overrides`` (checked again); an unknown name is a ``ConfigError``."""
        known = {f.name for f in fields(self) if f.init}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"unknown QwenConfig field(s) {unknown}")
        return dataclasses.replace(self, **overrides) if overrides else self

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "QwenConfig":
        """A published model shape by name (see ``mindqwen.presets.PRESETS``), with overrides."""
        from mindqwen.presets import PRESETS
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _yarn(cfg: QwenConfig, rs: Dict[str, Any]) -> tuple:
    """YaRN inverse frequencies and attention factor (transformers ``_compute_yarn_parameters``)."""
    base, dim = cfg.rope_theta, cfg.rotary_dim
    original_max = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    # As transformers 5: the ratio of the two lengths stands in only for a missing factor.
    factor = rs.get("factor") or cfg.max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32)
                                     / np.float32(dim))
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (np.float32(factor) * pos_freqs)
    inv_freq = (inv_interpolation * (1 - extrapolation_factor)
                + inv_extrapolation * extrapolation_factor)
    return inv_freq.astype(np.float32), float(attention_factor)


def _llama3(inv_freq: np.ndarray, rs: Dict[str, Any]) -> np.ndarray:
    """Llama 3.1 inverse frequencies (transformers ``_compute_llama3_parameters``), float32: wavelengths
    shorter than ``original / high_freq_factor`` keep their frequency, those longer than
    ``original / low_freq_factor`` are divided by ``factor``, and the band between is blended."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    original = rs["original_max_position_embeddings"]
    # A number divided by a torch tensor is its reciprocal times the number: rounded as such here.
    wavelen = (1 / inv_freq) * np.float32(2 * math.pi)
    scaled = np.where(wavelen > original / low, inv_freq / np.float32(factor), inv_freq)
    smooth = ((1 / wavelen) * np.float32(original) - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


LOW_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class ExecutionOptions:
    """How a built model executes, beside its shape (``QwenConfig``) and weights.

    A model is built with them (``QwenForCausalLM(config, options=...)``) or changes them in one
    call, ``mindqwen.models.graph.configure(model, **changes)``, which checks them here, hands
    them to every cell that reads one (its ``apply_options``) and invalidates the compiled graphs
    once. Precision (``fit``'s ``trainer.precision``) and sharding (``parallel``) go through it.

    Attributes:
        compute_dtype: "float16" | "bfloat16": the dtype of every matmul (AMP O1–O3); None: the weights'.
        hidden_dtype: the residual stream's dtype between layers (AMP O2/O3); None: the weights'.
        capacity_multiple: a mixture of experts' capacity rounded up to a multiple of this (the
            devices that split an expert group's tokens).
        batched_experts: run the exact (no-capacity) expert path as (E, N, H) batches too, so
            every graph slices the stacked expert weights alike (expert sharding).
        loss_chunk_rows: rows of logits per block of the chunked loss; None: the config's
            (``QwenConfig.loss_chunk_rows``); 0: all rows at once (a sharded head matmul).
        rotary_table: N: rotary cos/sin gathered from a table of positions 0..N-1 built once,
            so the graph holds no float64 op and no raw angle (exported graphs, whose cache
            holds N positions); None: computed per call, for any position.
        float64: a linear-attention layer's decays (exp, softplus) through float64 kernels where the
            device has them (the CPU: its fp32 exp is off by up to 1e-5 relative); False: the graph
            holds no float64 op (exported graphs, for converters and devices without them).
    """

    compute_dtype: Optional[str] = None
    hidden_dtype: Optional[str] = None
    capacity_multiple: int = 1
    batched_experts: bool = False
    loss_chunk_rows: Optional[int] = None
    rotary_table: Optional[int] = None
    float64: bool = True

    def __post_init__(self) -> None:
        for name in ("compute_dtype", "hidden_dtype"):
            if getattr(self, name) not in (None,) + LOW_DTYPES:
                raise ConfigError(f"{name} must be None or one of {', '.join(LOW_DTYPES)}, got {getattr(self, name)!r}")
        if not isinstance(self.capacity_multiple, int) or self.capacity_multiple < 1:
            raise ConfigError(f"capacity_multiple must be an integer >= 1, got {self.capacity_multiple!r}")
        if self.loss_chunk_rows is not None and (not isinstance(self.loss_chunk_rows, int) or self.loss_chunk_rows < 0):
            raise ConfigError(f"loss_chunk_rows must be None or an integer >= 0, got {self.loss_chunk_rows!r}")
        if self.rotary_table is not None and (not isinstance(self.rotary_table, int) or self.rotary_table < 1):
            raise ConfigError(f"rotary_table must be None or a number of positions >= 1, got {self.rotary_table!r}")
