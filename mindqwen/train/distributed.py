"""Parallel training: data parallel through ``msrun``; tensor and pipeline parallel on Ascend.

Under ``msrun`` every worker calls :func:`init_parallel`. With only data parallel, each rank reads
its shard of every global batch and the step all-reduces gradients (``nn.DistributedGradReducer``,
mean); this runs on CPU and Ascend. With tensor, pipeline or expert parallel degrees > 1,
MindSpore's semi-auto parallel takes over: :func:`shard_model` puts Megatron's layout on the
matmuls as shard strategies (and splits a mixture of experts' stacked experts by expert over the
data-parallel replicas), :func:`assign_pipeline_stages` splits the decoder layers into stages,
and the framework inserts the collectives. Semi-auto parallel needs Ascend (or GPU) communication:
MindSpore's CPU backend refuses it, so on CPU those degrees fail early with a clear error.
Outside ``msrun`` nothing is initialised: a single process never needs the launcher.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

import mindspore as ms
from mindspore import nn

from mindqwen.models.graph import configure

# Set by msrun for every worker.
_LAUNCHER_VARS = ("MS_WORKER_NUM", "MS_ROLE")


@dataclass
class ParallelConfig:
    """Attributes:
        data_parallel: replicas, each on its shard of the global batch.
        tensor_parallel: devices one layer's matmuls are split over (Ascend only).
        pipeline_parallel: stages the decoder layers are split into (Ascend only).
        pipeline_micro_batches: micro-batches per step in the pipeline (≥ pipeline_parallel).
        expert_parallel: groups a mixture of experts' experts are split into, each group held by
            data_parallel / expert_parallel of the replicas (Ascend only; must divide
            data_parallel and num_experts).
    The product data · tensor · pipeline must equal the number of devices.
    """

    data_parallel: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_micro_batches: int = 1
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("data_parallel", "tensor_parallel", "pipeline_parallel", "pipeline_micro_batches",
                     "expert_parallel"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.data_parallel % self.expert_parallel:
            raise ValueError(f"parallel.expert_parallel={self.expert_parallel} must divide data_parallel="
                             f"{self.data_parallel} (the experts are split over the data-parallel replicas)")
        if self.pipeline_parallel > 1 and self.pipeline_micro_batches < self.pipeline_parallel:
            raise ValueError(f"parallel.pipeline_micro_batches={self.pipeline_micro_batches} must be at least "
                             f"pipeline_parallel={self.pipeline_parallel} (otherwise stages idle)")

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel * self.pipeline_parallel

    @property
    def model_parallel(self) -> bool:
        """True when tensor, pipeline or expert parallel is used (semi-auto parallel, Ascend)."""
        return self.tensor_parallel * self.pipeline_parallel * self.expert_parallel > 1


def launched_by_msrun() -> bool:
    return all(v in os.environ for v in _LAUNCHER_VARS) and int(os.environ.get("MS_WORKER_NUM")) > 1


def init_parallel(parallel: Optional[ParallelConfig] = None) -> Tuple[int, int]:
    """(rank, world size); initialises communication only under a multi-worker msrun.

    Without an explicit layout (all degrees 1) every msrun worker is a data-parallel replica.
    """
    parallel = parallel or ParallelConfig()
    if parallel.model_parallel and ms.get_context("device_target") != "Ascend":
        raise ValueError(f"tensor_parallel={parallel.tensor_parallel} / pipeline_parallel="
                         f"{parallel.pipeline_parallel} / expert_parallel={parallel.expert_parallel} need "
                         "Ascend: MindSpore's semi-auto parallel does not "
                         f"run on the {ms.get_context('device_target')} backend; use data_parallel only")
    if not launched_by_msrun():
        if parallel.devices > 1:
            check_layout(parallel, 1)
        return 0, 1
    from mindspore.communication import get_group_size, get_rank, init
    init()  # HCCL on Ascend, MindSpore's own collective (MCCL) on CPU
    world = get_group_size()
    if parallel.devices > 1:
        check_layout(parallel, world)
    if parallel.model_parallel:
        # Every rank reads the whole global batch; the shard strategies slice it by data_parallel.
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, gradients_mean=True,
                                     pipeline_stages=parallel.pipeline_parallel, dataset_strategy="full_batch")
    else:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    return get_rank(), world


def check_layout(parallel: ParallelConfig, devices: int) -> None:
    """dp · tp · pp must equal the number of devices."""
    if parallel.devices != devices:
        raise ValueError(f"parallel layout data_parallel={parallel.data_parallel} × tensor_parallel="
                         f"{parallel.tensor_parallel} × pipeline_parallel={parallel.pipeline_parallel} = "
                         f"{parallel.devices}, but {devices} device{'s' if devices > 1 else ''} are used")


def check_model_layout(config, parallel: ParallelConfig, lora_rank: int = 0) -> None:
    """The tensor/pipeline degrees must fit the model's shape (raises ValueError naming the field)."""
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                 "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, name, 0) % tp:
            raise ValueError(f"tensor_parallel={tp} must divide {name}={getattr(config, name)}")
    if lora_rank % tp:
        raise ValueError(f"tensor_parallel={tp} must divide the LoRA rank {lora_rank}")
    if tp > 1 and getattr(config, "is_hybrid", False):
        raise ValueError(f"tensor_parallel={tp}: {config.model_type}'s linear-attention layers have no tensor-parallel "
                         "layout yet; use data (and pipeline) parallel")
    if parallel.expert_parallel > 1 and (not config.num_experts or config.num_experts % parallel.expert_parallel):
        raise ValueError(f"expert_parallel={parallel.expert_parallel} must divide num_experts={config.num_experts}"
                         + (" (this model is dense: use expert_parallel=1)" if not config.num_experts else ""))
    if pp > config.num_hidden_layers:
        raise ValueError(f"pipeline_parallel={pp} exceeds num_hidden_layers={config.num_hidden_layers}")
    if config.tie_word_embeddings and pp > 1:
        raise ValueError("tie_word_embeddings shares one matrix between the first and the last pipeline "
                         "stage; use pipeline_parallel=1 for this model (tensor or data parallel instead)")


def shard_model(model: nn.Cell, data_parallel: int, tensor_parallel: int, expert_parallel: int = 1) -> None:
    """Megatron's tensor-parallel layout as shard strategies (2-D matmul operands: x (T, in), W (out, in)).

    - column-parallel q/k/v/gate/up: W split by output rows → each device holds whole heads and
      a slice of the MLP width, no communication;
    - row-parallel o/down: W split by input columns → partial sums, all-reduced by the framework;
    - attention batch-matmuls split by KV-head group, so a device attends only to its heads;
    - the LM head split by vocabulary;
    - a mixture of experts: the stacked experts' batched matmuls (x (E, C, in), W (E, out, in))
      split by expert into ``expert_parallel`` groups, a group's C tokens over its dp/ep devices
      (C rounded up to a multiple of dp/ep), and within an expert like the MLP; the exact path
      batched the same way (``ExecutionOptions.batched_experts``), so every graph slices the weights alike;
      the shared expert like the MLP; the routers whole.
    LoRA layers keep the base layer's strategy; their rank must divide by tensor_parallel.
    """
    from mindqwen.lora import LoraAdapter
    dp, tp, ep = data_parallel, tensor_parallel, expert_parallel
    check_model_layout(model.config, ParallelConfig(dp, tp, expert_parallel=ep))
    column, row = ((dp, 1), (tp, 1)), ((dp, tp), (1, tp))
    expert_column, expert_row = ((ep, dp // ep, 1), (ep, tp, 1)), ((ep, dp // ep, tp), (ep, 1, tp))
    configure(model, capacity_multiple=dp // ep, batched_experts=model.config.num_experts > 0,
              loss_chunk_rows=0)  # the loss goes through the sharded head matmul
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        swiglus, linears = [mlp], []
        if layer.sparse:
            experts = mlp.experts
            linears = [(experts.gate_proj, expert_column), (experts.up_proj, expert_column),
                       (experts.down_proj, expert_row)]
            swiglus = [mlp.shared_expert] if mlp.has_shared_expert else []
            mlp.gate.matmul.shard(((dp, 1), (1, 1)))
            if mlp.has_shared_expert:
                mlp.shared_expert_gate.matmul.shard(((dp, 1), (1, 1)))
        linears += [(attn.q_proj, column), (attn.k_proj, column), (attn.v_proj, column), (attn.o_proj, row)]
        for m in swiglus:
            linears += [(m.gate_proj, column), (m.up_proj, column), (m.down_proj, row)]
        for linear, strategy in linears:
            if isinstance(linear, LoraAdapter) and linear.lora_a.shape[-2] % tp:
                raise ValueError(f"tensor_parallel={tp} must divide the LoRA rank {linear.lora_a.shape[-2]}")
            (linear.bmm if len(strategy[0]) == 3 else linear.matmul).shard(strategy)
        attn.bmm_qk.shard(((dp, tp, 1, 1), (dp, tp, 1, 1)))  # (B, KV, n_rep·S, D) · (B, KV, T, D)ᵀ
        attn.bmm_pv.shard(((dp, tp, 1, 1), (dp, tp, 1, 1)))  # (B, KV, n_rep·S, T) · (B, KV, T, D)
    head = model.head_matmul if model.tied else model.lm_head.matmul
    head.shard(column)


def assign_pipeline_stages(model: nn.Cell, stages: int) -> None:
    """Contiguous blocks of decoder layers per stage; embeddings on the first, norm and head on the last."""
    layers = model.model.layers
    check_model_layout(model.config, ParallelConfig(pipeline_parallel=stages, pipeline_micro_batches=stages))
    model.model.embed_tokens.pipeline_stage = 0
    for i, layer in enumerate(layers):
        layer.pipeline_stage = i * stages // len(layers)
    model.model.norm.pipeline_stage = stages - 1
    if not model.tied:  # a tied head is the embedding matrix (one stage only: check_model_layout)
        model.lm_head.pipeline_stage = stages - 1


def setup_model_parallel(model: nn.Cell, parallel: ParallelConfig, output_dir: str, rank: int) -> str:
    """Shard and stage ``model``; returns this rank's output folder (``output_dir/rank_<r>``).

    Each rank checkpoints its own slices; ``strategy.ckpt`` (the layout, written at compile time)
    lets ``mindspore.parallel.transform_checkpoints`` merge them into one full checkpoint.
    """
    shard_model(model, parallel.data_parallel, parallel.tensor_parallel, parallel.expert_parallel)
    assign_pipeline_stages(model, parallel.pipeline_parallel)
    folder = os.path.join(output_dir, f"rank_{rank}")
    ms.set_auto_parallel_context(strategy_ckpt_config={"save_file": os.path.join(folder, "strategy.ckpt")})
    return folder
