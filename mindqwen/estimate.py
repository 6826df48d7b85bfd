"""Memory per device for a recipe: weights, gradients, optimizer states, activations.

The model is the usual decomposition (ZeRO paper for states, Korthikanti et al. 2022 for
activations), written for mindqwen's own graph: what each layer keeps for the backward pass.
Per device under data (dp) × tensor (tp) × pipeline (pp) parallel, the worst pipeline stage:

    weights      params/(tp·pp) × bytes(param dtype)        embeddings on the first, head on the last stage;
                                                            routed experts also / ep (expert parallel)
    gradients    trainable/(tp·pp) × bytes(param dtype)     LoRA adapters are fp32
    optimizer    2 × trainable/(tp·pp) × bytes(param dtype)  AdamW m, v (in the parameters' dtype)
    accumulate   trainable/(tp·pp) × bytes(param dtype)     only with gradient_accumulation > 1
    activations  layers/pp × per-layer(tokens) / tp          or, with recompute, one layer's input per
                                                              layer plus one full layer
    logits       rows × vocab/tp × (2|4 + 4 + 4)            logits, fp32 copy, gradient (last stage);
                 rows = min(tokens, loss block rows), all tokens under tensor parallel
    runtime      the framework's own memory (measured once per device kind)

On CPU the activation term is scaled by a measured factor (see ``CPU_ACTIVATION_FACTOR``).

A stage's layers are summed (the heaviest run of ceil(layers/pp) consecutive layers), so a hybrid
model (Qwen3.5) counts each layer as what it is: a gated full-attention layer, or a Gated DeltaNet
layer, whose weights are ``QwenConfig.linear_attention_shapes`` and which keeps no attention scores
but the chunked delta rule's fp32 work and the recurrent state entering each chunk
(``linear_attention_activation_bytes``).

A multimodal recipe adds the vision tower, the projector and the gated cross-attention blocks
(``multimodal_parameters``, a closed form of ``mindqwen.multimodal``'s Cells) to the weights,
its groups' trainable parameters (frozen | lora | full, as the recipe's policy sets them) to the
gradients and optimizer states, and what the tower and the cross-attention keep for backward
to the activations (the same per-tensor model as the LM's, not calibrated separately).

A device fits when the total is ≤ 90% of its memory (10% headroom for the runtime and fragmentation).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from mindqwen.config import QwenConfig

GB = 1024 ** 3
HEADROOM = 0.9
# device → (memory GB, runtime overhead GB). Ascend: HCCL buffers and the operator workspace;
# CPU: MindSpore's resident runtime and compiled graph, measured on this machine kind
# (benchmarks/estimate_check.py).
DEVICES: Dict[str, Tuple[float, float]] = {"910B": (64.0, 3.0), "910A": (32.0, 3.0), "310P": (24.0, 2.0)}
# MindSpore's CPU step, with the graph-kernel fusion mindqwen turns on by default, keeps ~0.77×
# what the layers save for backward (unfused it kept ~5.3×: per-kernel index buffers), and
# recompute lowers it little (docs/performance.md). Both CPU figures are a least-squares fit to
# six measured bench-small configurations (benchmarks/estimate_check.py, within −13%…+12%);
# the test checks a configuration outside the fit.
CPU_RUNTIME_GB = 0.78
CPU_ACTIVATION_FACTOR = 0.77
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# logits (low precision under O2/O3, else fp32) + their fp32 copy for the loss + its gradient
LOGIT_BYTES = {False: 4 + 4 + 4, True: 2 + 4 + 4}


@dataclass
class Estimate:
    parts: Dict[str, float]  # name → bytes
    device: str
    capacity: float  # bytes
    notes: List[str]
    parameters: Tuple[int, int] = ()  # (total, active per token)
    groups: Dict[str, int] = field(default_factory=dict)  # multimodal: parameters per group

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= HEADROOM * self.capacity


def mixer_parameters(config: QwenConfig, index: int) -> int:
    """Parameters of decoder layer ``index``'s token mixer: a Gated DeltaNet
    (``QwenConfig.linear_attention_shapes``) or attention, whose q_proj in a hybrid model also
    gives each head's output gate."""
    if config.layer_types[index] == "linear_attention":
        return sum(math.prod(shape) for shape in config.linear_attention_shapes().values())
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    q_rows = 2 * q if config.is_hybrid else q
    return (h * q_rows + 2 * h * kv + q * h + (q_rows + 2 * kv if config.qkv_bias else 0)
            + (2 * d if config.qk_norm else 0) + (h if config.o_bias else 0))


def layer_parameters(config: QwenConfig, index: int) -> Tuple[int, int]:
    """(total, active per token) parameters of decoder layer ``index``: a mixture of experts holds
    every expert but runs the router, its k experts and the shared expert."""
    h = config.hidden_size
    attn = mixer_parameters(config, index) + 2 * h  # and the two norms
    if not config.is_sparse(index):
        return attn + 3 * h * config.intermediate_size, attn + 3 * h * config.intermediate_size
    always = attn + config.num_experts * h  # the router
    if config.shared_expert_intermediate_size:
        always += 3 * h * config.shared_expert_intermediate_size + h  # and its sigmoid gate
    expert = routed_expert_parameters(config) // config.num_experts
    return always + config.num_experts * expert, always + config.num_experts_per_tok * expert


def routed_expert_parameters(config: QwenConfig) -> int:
    """A mixture-of-experts layer's routed experts: E SwiGLUs of width moe_intermediate_size."""
    return config.num_experts * 3 * config.hidden_size * config.moe_intermediate_size


def embedding_parameters(config: QwenConfig) -> Tuple[int, int]:
    """(embedding, separate LM head) parameter counts."""
    embed = config.vocab_size * config.hidden_size
    return embed, 0 if config.tie_word_embeddings else embed


def heaviest_stage(per_layer: List[float], stage_layers: int) -> float:
    """The largest sum of ``stage_layers`` consecutive layers' values: what the fullest pipeline
    stage holds (every layer without a pipeline; ``stage_layers`` × one layer when all are alike)."""
    return max(sum(per_layer[i:i + stage_layers]) for i in range(len(per_layer) - stage_layers + 1))


def model_parameters(config: QwenConfig) -> Tuple[int, int]:
    """(total, active per token) parameters of the whole model, final norm included."""
    layers = [layer_parameters(config, i) for i in range(config.num_hidden_layers)]
    embed, head = embedding_parameters(config)
    rest = embed + head + config.hidden_size
    return sum(t for t, _ in layers) + rest, sum(a for _, a in layers) + rest


def vision_parameters(v) -> int:
    """The ViT (``mindqwen.multimodal.vision.VisionEncoder``) of a ``VisionConfig``: patch
    embedding, position table, blocks (LayerNorm, attention with biases, MLP; video adds a
    temporal attention and its norm per block and a frame table), final LayerNorm."""
    d, i = v.hidden_size, v.intermediate_size
    attention = 4 * (d * d + d)
    block = 2 * d + attention + 2 * d + (d * i + i) + (i * d + d)
    embed = v.num_channels * v.patch_size ** 2 * d + d + v.num_patches * d
    if v.num_frames > 1:
        block += 2 * d + attention
        embed += v.num_frames * d
    return embed + v.num_hidden_layers * block + 2 * d


def multimodal_parameters(config: QwenConfig, vision, cross_layers) -> Dict[str, int]:
    """Parameters of what a multimodal model adds to its LM, per group: the ViT, the projector
    (Linear(Dv, H) → GELU → Linear(H, H), with biases) and each gated cross-attention block
    (RMSNorm, q/k/v/o without bias, q/k RMSNorm over the head, a scalar gate)."""
    h, dv = config.hidden_size, vision.hidden_size
    head = h // config.num_attention_heads
    return {"vision": vision_parameters(vision), "projector": dv * h + h + h * h + h,
            "cross_attention": len(cross_layers) * (h + 4 * h * h + 2 * head + 1)}


def multimodal_activation_bytes(config: QwenConfig, vision, cross_layers, batch: int, seq: int) -> float:
    """What the ViT, the projector and the cross-attention blocks keep for backward (fp32)."""
    d, i, heads = vision.hidden_size, vision.intermediate_size, vision.num_attention_heads
    frames, patches = vision.num_frames, vision.num_patches
    tokens = batch * frames * patches
    block = tokens * (10 * d + 2 * i) * 4 + batch * frames * heads * patches ** 2 * 4 * 2
    if frames > 1:  # attention across the frames of each patch
        block += tokens * 6 * d * 4 + batch * patches * heads * frames ** 2 * 4 * 2
    h, per_sample = config.hidden_size, frames * patches  # vision tokens each text token attends to
    cross = batch * seq * 8 * h * 4 + batch * config.num_attention_heads * seq * per_sample * 4 * 2
    return vision.num_hidden_layers * block + tokens * (2 * h) * 4 + len(cross_layers) * cross


def lora_counts(config: QwenConfig, lora, expert_parallel: int = 1) -> List[float]:
    """Adapter parameters on one device per decoder layer (every Linear LoRA matches: attention or
    linear attention, MLP, each expert; the experts' split ``expert_parallel`` ways)."""
    per_layer = [0.0] * config.num_hidden_layers
    for name, shape in config.tensor_shapes().items():
        if name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2 \
                and not name.endswith("mlp.gate.weight") and lora.matches(name[:-len(".weight")]):
            share = 1 / expert_parallel if ".mlp.experts." in name else 1
            per_layer[int(name.split(".")[2])] += lora.r * sum(shape) * share
    return per_layer


def activation_bytes_per_layer(config: QwenConfig, index: int, tokens: int, seq: int, low_precision: bool,
                               flash: bool, sharded: bool = False, tp: int = 1) -> float:
    """What decoder layer ``index`` keeps for backward, for ``tokens`` = micro_batch × seq (a
    mixture of experts: ``expert_activation_bytes``; a Gated DeltaNet layer:
    ``linear_attention_activation_bytes``)."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_attention_heads
    act = 2 if low_precision else 4
    mlp = (expert_activation_bytes(config, tokens, act, sharded, tp) if config.is_sparse(index)
           else tokens * 4 * i * act)
    if config.layer_types[index] == "linear_attention":  # its two norms (fp32), no scores
        return tokens * 2 * h * 4 + linear_attention_activation_bytes(config, tokens, seq, act) + mlp
    hidden = tokens * 12 * h * act + mlp  # norms (fp32 copies), q/k/v, rotary, attention out; MLP
    if config.is_hybrid:  # the output gate and its sigmoid
        hidden += tokens * 2 * n * config.head_dim * act
    # fp32 scores and probabilities; flash attention (Ascend) keeps only per-row softmax statistics
    scores = tokens * n * 4 * 2 if flash else tokens * n * seq * 4 * 2
    return hidden + scores


def linear_attention_activation_bytes(config: QwenConfig, tokens: int, seq: int, act: int) -> float:
    """A Gated DeltaNet layer's token mixer (``mindqwen.models.deltanet``) for ``tokens`` = rows × seq.
    It has no scores and no KV cache. In ``act`` bytes: the projections (conv_dim + value_dim + 2·Hv),
    the convolution and its SiLU (2·conv_dim), the output projection's input (value_dim). In fp32: the
    gated norm (4·value_dim) and the chunked delta rule, per value head and token (padded to whole
    chunks of C): 6 key-dim vectors (q, k, β·k, the decay-weighted q and k, W), 7 value-dim ones (v,
    β·v, U, V', the two output products and their sum), 6 rows of the chunk's C × C matrices (segment
    sums, decay, A, (I + A)⁻¹ and its work, Q·Kᵀ ⊙ D), and twice the dk × dv recurrent state per C
    tokens (the state entering each chunk and its decayed copy). Counted from the graph, not measured."""
    from mindqwen.models.deltanet import CHUNK_SIZE as C
    hv, dk, dv = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    value_dim = hv * dv
    conv_dim = 2 * config.linear_num_key_heads * dk + value_dim
    padded = tokens // seq * math.ceil(seq / C) * C
    projections = tokens * (3 * conv_dim + 2 * value_dim + 2 * hv) * act + tokens * 4 * value_dim * 4
    rule = padded * hv * (6 * dk + 7 * dv + 6 * C + 2 * dk * dv / C) * 4
    return projections + rule


def expert_activation_bytes(config: QwenConfig, tokens: int, act: int, sharded: bool, tp: int = 1) -> float:
    """A mixture-of-experts layer's MLP part for a device's ``tokens``: every (token, expert) row
    the experts compute keeps gate, up, their SwiGLU and product (4·I), plus its own copy of the
    token (H) when gathered (capacity) or batched (``sharded``, semi-auto parallel); exact, every
    expert computes every token, ``moe_capacity_factor`` f about f·k rows per token. Expert
    parallel does not change a device's rows (E/ep experts × a dp/ep-th of the global tokens);
    tensor parallel splits I but not the token copy (the caller divides the layer by ``tp``).
    Plus the router's fp32 logits, probabilities and weights, and the shared expert as a dense MLP."""
    e, f = config.num_experts, config.moe_capacity_factor
    rows = tokens * (e if f is None else min(e, f * config.num_experts_per_tok))
    gathered = f is not None or sharded
    routed = rows * (4 * config.moe_intermediate_size + (config.hidden_size * tp if gathered else 0)) * act
    return routed + tokens * e * 4 * 3 + tokens * 4 * config.shared_expert_intermediate_size * act


def estimate(config: QwenConfig, lora, trainer, parallel, model_dtype: str, seq: int, device: str) -> Estimate:
    """The memory of the worst device; ``device`` is 910B | 910A | 310P | CPU | a size in GB."""
    capacity, runtime, label = _device(device)
    cpu = label.startswith("CPU")
    flash = not cpu  # mindqwen uses flash attention on Ascend
    tp, pp, ep = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel
    embed, head = embedding_parameters(config)
    held = routed_expert_parameters(config) * (1 - 1 / ep)  # a device holds E/ep of the experts
    layers = [layer_parameters(config, i)[0] - (held if config.is_sparse(i) else 0)
              for i in range(config.num_hidden_layers)]
    stage_layers = math.ceil(config.num_hidden_layers / pp)
    stage = heaviest_stage(layers, stage_layers)
    first = stage + embed + (0 if pp > 1 else head)
    last = stage + head + (embed if config.tie_word_embeddings and pp == 1 else 0)
    params = max(first, last) / tp
    level = trainer.precision.level
    weight_bytes = BYTES[trainer.precision.dtype] if level == "O3" else BYTES[model_dtype]
    if lora is not None:
        trainable, state_bytes = heaviest_stage(lora_counts(config, lora, ep), stage_layers) / tp, 4
    else:
        trainable, state_bytes = params, weight_bytes
    # A pipeline splits the micro-batch into pipeline_micro_batches; a stage holds up to pp in flight.
    micro = parallel.pipeline_micro_batches if pp > 1 else 1
    tokens = trainer.micro_batch_size * seq // micro
    in_flight = tokens * min(pp, micro)
    per_layer = [activation_bytes_per_layer(config, i, in_flight, seq, level in ("O2", "O3"), flash,
                                            parallel.model_parallel, tp) / tp for i in range(config.num_hidden_layers)]
    # The loss takes the logits in blocks of loss_chunk_rows rows, except under tensor parallel.
    logit_rows = tokens if tp > 1 else min(tokens, config.loss_chunk_rows)
    if cpu:
        kept = CPU_ACTIVATION_FACTOR * heaviest_stage(per_layer, stage_layers)
    elif trainer.recompute == "full":
        kept = stage_layers * in_flight * config.hidden_size * 4 / tp + max(per_layer)
    else:
        kept = heaviest_stage(per_layer, stage_layers)
    parts = {"weights": params * weight_bytes, "gradients": trainable * state_bytes,
             "optimizer": 2 * trainable * state_bytes, "activations": kept,
             "logits": logit_rows * config.vocab_size / tp * LOGIT_BYTES[level in ("O2", "O3")], "runtime": runtime}
    if trainer.gradient_accumulation > 1:
        parts["accumulators"] = trainable * state_bytes
    notes = [] if trainer.recompute == "full" or cpu else ["trainer.recompute=full"]
    return Estimate(parts, label, capacity, notes, model_parameters(config))


def _device(device: str) -> Tuple[float, float, str]:
    """(capacity bytes, runtime bytes, label)."""
    if device.upper() == "CPU":
        with open("/proc/meminfo") as f:
            total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return total_kb * 1024, CPU_RUNTIME_GB * GB, f"CPU ({total_kb / 1024 ** 2:.0f} GB)"
    if device.upper() in DEVICES:
        memory, runtime = DEVICES[device.upper()]
        return memory * GB, runtime * GB, f"Ascend {device.upper()} ({memory:.0f} GB)"
    try:
        memory = float(device)
    except ValueError:
        raise ValueError(f"--device must be 910B, 910A, 310P, CPU or a size in GB, got {device!r}") from None
    return memory * GB, DEVICES["910B"][1] * GB, f"{memory:g} GB device"


def estimate_recipe(recipe, device: str) -> Estimate:
    """The recipe's memory per device; the architecture comes from the checkpoint's config.json,
    or from ``model.preset`` when the checkpoint is not on this machine (no weights are read)."""
    from mindqwen.train.validate import recipe_model_config
    m = recipe.model
    if m.checkpoint and m.preset and not os.path.isfile(os.path.join(m.checkpoint, "config.json")):
        config = QwenConfig.from_preset(m.preset, **m.config)
    elif recipe.multimodal is not None:  # the tokenizer's vocabulary and <image>
        from mindqwen.tasks.multimodal import MultimodalTask
        config = recipe_model_config(recipe, "recipe", MultimodalTask(recipe).image_id() + 1)
    else:
        config = recipe_model_config(recipe, "recipe")
    e = estimate(config, recipe.lora, recipe.trainer, recipe.parallel, recipe.model.dtype,
                 recipe.data.seq_length, device)
    return e if recipe.multimodal is None else _with_multimodal(e, config, recipe)


def _with_multimodal(e: Estimate, config: QwenConfig, recipe) -> Estimate:
    """``e`` (the LM alone, nothing trainable) with the multimodal groups added."""
    from mindqwen.multimodal.fusion import MultimodalQwen, apply_multimodal_lora, trainable_by_group
    from mindqwen.io.hf import no_init_parameters
    from mindqwen.models.qwen import QwenForCausalLM
    m, weight_bytes = recipe.multimodal, BYTES[recipe.model.dtype]
    groups = {"text": model_parameters(config)[0], **multimodal_parameters(config, m.vision, m.cross_layers)}
    with no_init_parameters():  # shapes only: which parameters the policy trains (LoRA ranks, targets)
        model = MultimodalQwen(QwenForCausalLM(config), m.vision, m.cross_layers, m.shapes.vocab_size)
    trainable = trainable_by_group(apply_multimodal_lora(model, m.policy))
    # LoRA adapters are fp32; a fully trained group keeps its states in the parameters' dtype
    state = sum(n * (4 if getattr(m.policy, g).mode == "lora" else weight_bytes) for g, n in trainable.items())
    activations = multimodal_activation_bytes(config, m.vision, m.cross_layers, recipe.trainer.micro_batch_size,
                                              recipe.data.seq_length)
    parts = dict(e.parts, weights=sum(groups.values()) * weight_bytes, gradients=state, optimizer=2 * state,
                 activations=e.parts["activations"] + (CPU_ACTIVATION_FACTOR if e.device.startswith("CPU") else 1)
                 * activations)
    if "accumulators" in parts:
        parts["accumulators"] = state
    total = sum(groups.values())
    return Estimate(parts, e.device, e.capacity, e.notes, (total, total), groups)


def _count(n: int) -> str:
    """Billions for real models, the exact count for tiny ones (0.00 B says nothing)."""
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n:,}"


def format_estimate(e: Estimate) -> str:
    lines = [f"memory per device on {e.device}:"] if not e.parameters else [
        f"parameters: {_count(e.parameters[0])}" + (f", {_count(e.parameters[1])} active per token"
                                                   if e.parameters[1] != e.parameters[0] else ""),
        f"memory per device on {e.device}:"]
    if e.groups:
        lines.insert(1, "  " + ", ".join(f"{g.replace('_', '-')} {n:,}" for g, n in e.groups.items()))
    lines += [f"  {name:12s} {value / GB:8.2f} GB" for name, value in e.parts.items()]
    lines.append(f"  {'total':12s} {e.total / GB:8.2f} GB of {HEADROOM:.0%} × {e.capacity / GB:.0f} GB = "
                 f"{HEADROOM * e.capacity / GB:.1f} GB usable: {'fits' if e.fits else 'does NOT fit'}")
    if not e.fits:
        lines.append("  to fit: trainer.micro_batch_size smaller (activations, logits scale with it; raise "
                     "gradient_accumulation to keep the batch), " + ", ".join(
                         e.notes + ["LoRA instead of full fine-tuning", "more tensor_parallel / pipeline_parallel"]))
    return "\n".join(lines)
