"""The training step as graph-mode Cells, compiled once per input shape.

    1. loss · scale, and its gradients w.r.t. the trainable parameters only
    2. (accumulation) gradients × the micro-batch's share of the step's items (label tokens for a
       causal LM) added into accumulator Parameters, so the step's loss and gradients are those
       of one batch of all its rows
    3. unscale: ÷ loss scale (and ÷ pipeline micro-batches)
    4. data parallel: all-reduce (mean) across ranks
    5. global gradient norm (fp32 sum of squares), clipped to ``clip_norm``
    6. overflow check: the norm is finite (an inf or NaN in any gradient makes it inf or NaN)
    7. optimizer update, skipped when a gradient overflowed
    8. loss-scale adjustment (fp16 only): halve on overflow, grow after a clean window

``TrainStep`` fuses 1–8 for one micro-batch; ``AccumulateStep`` (1–2) and ``ApplyAccumulated``
(3–8) split them for gradient accumulation. No Python state changes per call.
"""
from __future__ import annotations

from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import nn, ops

from mindqwen.config import IGNORE_INDEX
from mindqwen.models.graph import invalidate_compiled_graphs, sync_with_weights
from mindqwen.train.distributed import ParallelConfig

_hyper_map = ops.HyperMap()
CLIP_EPS = 1e-6  # as torch's clip_grad_norm_


class CausalLMLoss(nn.Cell):
    """The default loss: ``model(input_ids, labels=labels)`` of a causal LM.

    A loss network may report more than the loss: it then returns (loss, *reported) and names
    them in ``reported`` (here a mixture of experts' unweighted load-balancing loss and the share
    of assignments its capacity dropped); the step
    differentiates the loss only and hands the rest to the metrics.
    """

    def __init__(self, model: nn.Cell, report: bool = True):
        """report: return a mixture of experts' aux loss too (not under pipeline parallel, whose
        micro-batch cell takes the loss alone)."""
        super().__init__(auto_prefix=False)
        self.model = model
        config = getattr(model, "config", None)
        self.reported = ()
        if getattr(config, "num_experts", 0) and report:
            dropped = ("moe_dropped",) if config.moe_capacity_factor is not None else ()
            self.reported = ("aux_loss",) + dropped

    def construct(self, input_ids, labels, position_ids=None):
        """input_ids, labels (B, S) int32; position_ids (B, S) int32: packed samples (``TokenDataset``)."""
        if self.reported:
            return self.model.loss_and_aux_loss(input_ids, None, labels, position_ids)
        return self.model(input_ids, None, labels, position_ids)

    def items(self, batch: tuple) -> int:
        """The label tokens of a batch (after the next-token shift): what its loss averages over."""
        labels = batch[1].asnumpy() if isinstance(batch[1], ms.Tensor) else np.asarray(batch[1])
        return int(np.count_nonzero(labels[:, 1:] != IGNORE_INDEX))


def batch_items(loss_net: nn.Cell, batch: tuple) -> int:
    """What a loss network's loss averages over in ``batch``: its ``items(batch)`` (a causal LM's
    label tokens), or else the batch's rows (a preference loss averages over pairs)."""
    items = getattr(loss_net, "items", None)
    return items(batch) if items is not None else len(batch[0])


class ScaledLoss(nn.Cell):
    """loss_net(*batch) × loss scale: the function the gradients are taken of (reported values
    pass through unscaled)."""

    def __init__(self, loss_net: nn.Cell, scaler: ms.amp.DynamicLossScaler):
        super().__init__(auto_prefix=False)
        self.loss_net, self.scaler = loss_net, scaler
        self.reports = bool(reported_names(loss_net))

    def construct(self, *batch):
        out = self.loss_net(*batch)
        if self.reports:
            return (self.scaler.scale(out[0]),) + out[1:]
        return self.scaler.scale(out)


def reported_names(loss_net: nn.Cell) -> tuple:
    """Names of the values a loss network returns after the loss (see ``CausalLMLoss``)."""
    return tuple(getattr(loss_net, "reported", ()))


class GradStep(nn.Cell):
    """Step 1: (loss, scaled gradients); under data parallel the loss is the mean over ranks.

    With ``pipeline_micro_batches`` > 1 (pipeline parallel) the batch is cut into that many
    micro-batches that flow through the stages; loss and gradients are their sums.
    """

    def __init__(self, loss_net: nn.Cell, optimizer: nn.Optimizer, scaler: ms.amp.DynamicLossScaler,
                 world: int = 1, pipeline_micro_batches: int = 1):
        super().__init__(auto_prefix=False)
        self.scaler, self.world = scaler, world
        self.reports = bool(reported_names(loss_net))
        loss_net = ScaledLoss(loss_net, scaler)
        if pipeline_micro_batches > 1:
            if self.reports:
                raise ValueError("pipeline parallel takes a loss network that returns the loss alone, "
                                 f"not also {reported_names(loss_net.loss_net)}")
            loss_net = nn.PipelineCell(loss_net, pipeline_micro_batches)
        self.pipeline_micro_batches = float(pipeline_micro_batches)
        # Held as an attribute so that every parameter, frozen ones included, belongs to the
        # compiled cell: a graph loaded from MindSpore's compile cache binds only those, and an
        # unbound frozen weight reads as garbage (measured: a LoRA step's loss stuck at ln(vocab)).
        self.loss_net = loss_net
        self.grad_fn = ms.value_and_grad(loss_net, None, optimizer.parameters, has_aux=self.reports)
        self.all_reduce = ops.AllReduce() if world > 1 else None

    def construct(self, *batch):
        """→ loss, the reported values (a tuple, maybe empty), gradients."""
        out, grads = self.grad_fn(*batch)
        scaled_loss, reported = (out[0], out[1:]) if self.reports else (out, ())
        loss = self.scaler.unscale(scaled_loss) / self.pipeline_micro_batches
        if self.all_reduce is not None:
            loss = self.all_reduce(loss) / self.world
            reported = tuple(self.all_reduce(r) / self.world for r in reported)
        return loss, reported, grads


class ApplyGrads(nn.Cell):
    """Steps 3–8 on summed, scaled gradients; returns (finite, grad_norm)."""

    def __init__(self, optimizer: nn.Optimizer, scaler: ms.amp.DynamicLossScaler, clip_norm: float,
                 dynamic_scaling: bool, reducer: Optional[nn.Cell] = None):
        super().__init__(auto_prefix=False)
        self.optimizer, self.scaler, self.reducer = optimizer, scaler, reducer
        self.clip_norm, self.dynamic_scaling = float(clip_norm), dynamic_scaling

    def construct(self, grads, divisor):
        grads = self.scaler.unscale(grads)  # 3.
        if divisor is not None:
            grads = _hyper_map(ops.partial(_div_grad, divisor), grads)
        if self.reducer is not None:  # 4.
            grads = self.reducer(grads)
        # 5. HyperMap, not a comprehension: graph mode compiles a comprehension as nested calls,
        # one level per gradient, past MindSpore's depth limit of 1000 at ~500 gradients (LoRA on
        # every projection of Qwen3-30B-A3B's 48 layers is 672).
        norm = ops.sqrt(ops.addn(_hyper_map(_square_sum, grads)))
        # 6. One scalar test instead of ``ms.amp.all_finite`` (IsFinite + ReduceAll per tensor:
        # 53 ms of a 980 ms full fine-tune step on CPU). It also flags finite gradients whose
        # squares overflow fp32 (|g| > 1.8e19), which clipping would have zeroed anyway.
        finite = ops.isfinite(norm)
        if self.clip_norm > 0:
            factor = ops.minimum(self.clip_norm / (norm + CLIP_EPS), 1.0)
            grads = _hyper_map(ops.partial(_scale_grad, factor), grads)
        if finite:  # 7.
            finite = ops.depend(finite, self.optimizer(grads))
        if self.dynamic_scaling:  # 8.
            finite = ops.depend(finite, self.scaler.adjust(finite))
        return finite, norm


def _square_sum(g):
    return ops.reduce_sum(ops.square(g.astype(ms.float32)))


def _scale_grad(factor, g):
    return g * factor.astype(g.dtype)


def _div_grad(divisor, g):
    return g / divisor.astype(g.dtype)


class TrainStep(nn.Cell):
    """One optimizer step on one micro-batch: returns (loss, finite, grad_norm)."""

    def __init__(self, grad_step: GradStep, update: ApplyGrads, divisor: int = 1):
        super().__init__(auto_prefix=False)
        self.grad_step, self.update = grad_step, update
        self.divisor = ms.Tensor(float(divisor), ms.float32) if divisor > 1 else None

    def construct(self, *batch):
        loss, reported, grads = self.grad_step(*batch)
        finite, norm = self.update(grads, self.divisor)
        return loss, finite, norm, reported


class AccumulateStep(nn.Cell):
    """Steps 1–2 for one micro-batch; returns its weighted loss and reported values.

    The weight multiplies the gradients, not the loss that is differentiated: the same numbers
    (the gradient is linear in the loss), and a graph input kept out of the differentiation, whose
    backward MindSpore 2.10 fails to compile beside a loss with its own bprop."""

    def __init__(self, grad_step: GradStep, accumulators: ms.ParameterTuple):
        super().__init__(auto_prefix=False)
        self.grad_step, self.accumulators = grad_step, accumulators

    def construct(self, weight, *batch):
        """weight: the micro-batch's share of the step's items (float32 scalar)."""
        loss, reported, grads = self.grad_step(*batch)
        grads = _hyper_map(ops.partial(_scale_grad, weight), grads)
        return ops.depend(loss * weight, _hyper_map(ops.assign_add, self.accumulators, grads)), reported


class ApplyAccumulated(nn.Cell):
    """Steps 3–8 on the accumulated gradients, then zero the accumulators."""

    def __init__(self, update: ApplyGrads, accumulators: ms.ParameterTuple, divisor: int = 1):
        super().__init__(auto_prefix=False)
        self.update, self.accumulators = update, accumulators
        self.divisor = ms.Tensor(float(divisor), ms.float32) if divisor > 1 else None

    def construct(self):
        finite, norm = self.update(self.accumulators, self.divisor)
        zeros = _hyper_map(ops.zeros_like, self.accumulators)
        return ops.depend(finite, _hyper_map(ops.assign, self.accumulators, zeros)), norm


class Stepper:
    """Host-side driver: one ``__call__`` = one optimizer step over ``micro_batches`` batches.

    Args:
        model: the network (``model(ids, None, labels)`` returns the loss).
        loss_net: what the batches feed, returning the loss (default ``CausalLMLoss(model)``:
            batches of (input_ids, labels)); e.g. a multimodal loss over (ids, pixels, labels).
            One with a ``prepare(batch)`` method has it add inputs to each batch on the host
            before the step (the reference log-probs of ``PreferenceLoss``), in the timed step.
        optimizer: over the trainable parameters.
        scaler: loss scaler (scale 1 and ``dynamic_scaling=False`` outside fp16).
        micro_batches: gradient accumulation factor. Each micro-batch's loss is weighted by its
            share of the step's items (``batch_items``: label tokens for a causal LM), so an
            accumulated step equals one batch of the same rows.
        clip_norm: global-norm clip (0 disables).
        world: data-parallel ranks (> 1: gradients and the loss are averaged across them).
        parallel: a tensor/pipeline-parallel layout (semi-auto parallel, Ascend): the framework
            then inserts the gradient reductions, and pipeline micro-batches are summed.
    """

    def __init__(self, model: nn.Cell, optimizer: nn.Optimizer, scaler: ms.amp.DynamicLossScaler,
                 micro_batches: int = 1, clip_norm: float = 1.0, dynamic_scaling: bool = False,
                 world: int = 1, parallel: Optional[ParallelConfig] = None,
                 loss_net: Optional[nn.Cell] = None):
        if sync_with_weights(model):  # a weight frozen or thawed since the model last looked
            invalidate_compiled_graphs(model)
        pipeline = 1
        if parallel is not None and parallel.model_parallel:
            pipeline = parallel.pipeline_micro_batches if parallel.pipeline_parallel > 1 else 1
            reducer = nn.PipelineGradReducer(optimizer.parameters) if pipeline > 1 else None
            world = 1  # semi-auto parallel: loss and gradients come out already reduced
        else:
            reducer = nn.DistributedGradReducer(optimizer.parameters, mean=True, degree=world) if world > 1 else None
        loss_net = loss_net or CausalLMLoss(model)
        self.prepare = getattr(loss_net, "prepare", None)  # host-side inputs the loss adds to a batch
        self.reported_names = reported_names(loss_net)
        self.reported = {}  # the last step's reported values (micro-batch means), e.g. aux_loss
        grad_step = GradStep(loss_net, optimizer, scaler, world, pipeline)
        update = ApplyGrads(optimizer, scaler, clip_norm, dynamic_scaling, reducer)
        self.micro_batches, self.loss_net = micro_batches, loss_net
        if micro_batches == 1:
            self.step = TrainStep(grad_step, update, pipeline)
        else:
            # "accum" is taken: nn.SGD names its momentum buffers so, and a name clash makes
            # MindSpore rename every parameter by its cell path at compile time.
            accumulators = optimizer.parameters.clone(prefix="grad_accum", init="zeros")
            self.accumulate = AccumulateStep(grad_step, accumulators)
            self.apply = ApplyAccumulated(update, accumulators, pipeline)

    def __call__(self, batches):
        """batches: ``micro_batches`` Tensor tuples (default (input_ids, labels)) → (mean loss, finite, norm);
        the loss network's reported values land in ``self.reported``."""
        if self.prepare is not None:
            batches = [self.prepare(batch) for batch in batches]
        if self.micro_batches == 1:
            batch, = batches
            loss, finite, norm, reported = self.step(*batch)
            self.reported = {k: float(v.asnumpy()) for k, v in zip(self.reported_names, reported)}
            return float(loss.asnumpy()), bool(finite.asnumpy()), float(norm.asnumpy())
        outs = [self.accumulate(weight, *batch) for weight, batch in zip(self.weights(batches), batches)]
        finite, norm = self.apply()
        self.reported = {k: float(np.mean([out[1][i].asnumpy() for out in outs]))
                         for i, k in enumerate(self.reported_names)}
        return sum(float(out[0].asnumpy()) for out in outs), bool(finite.asnumpy()), float(norm.asnumpy())

    def weights(self, batches) -> list:
        """Each micro-batch's share of the step's items (equal shares if the step has none)."""
        items = [batch_items(self.loss_net, batch) for batch in batches]
        total = sum(items)
        return [ms.Tensor(n / total if total else 1.0 / len(items), ms.float32) for n in items]
