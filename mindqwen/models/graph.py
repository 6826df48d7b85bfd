"""Compiled graphs: how a model executes (``configure``), keeping MindSpore's cache honest after a
Cell tree changes, running a block in a given execution mode, and compiling equal decoder layers
once (``share_layer_graphs``)."""
import contextlib
import dataclasses
import hashlib
import time
from typing import Callable, Iterator, Optional, Protocol, TypeVar

import mindspore as ms
from mindspore import nn, ops

from mindqwen.config import ExecutionOptions

T = TypeVar("T")


def configure(model: nn.Cell, **changes) -> ExecutionOptions:
    """Change how ``model`` executes (fields of ``ExecutionOptions``): the one writer of those
    settings. The new options are checked, handed to every cell that reads one, and the compiled
    graphs invalidated once.

    The options of a tree are those of the models in it (``QwenForCausalLM.options``; a fused
    multimodal model's are its LM's); all of them take the new ones.

    Raises:
        ConfigError: a value out of range (naming the option); TypeError: an unknown option.
    """
    holders = [cell for _, cell in model.cells_and_names() if isinstance(getattr(cell, "options", None),
                                                                         ExecutionOptions)]
    options = dataclasses.replace(holders[0].options if holders else ExecutionOptions(), **changes)
    for holder in holders:
        holder.options = options
    apply_options(model, options)
    invalidate_compiled_graphs(model)
    return options


def apply_options(model: nn.Cell, options: ExecutionOptions) -> None:
    """Hand ``options`` to every cell of ``model`` that reads one (its ``apply_options``)."""
    for _, cell in model.cells_and_names():
        if hasattr(cell, "apply_options"):
            cell.apply_options(options)


def low_dtype(name: Optional[str]):
    """An ``ExecutionOptions`` dtype name → the MindSpore dtype (None stays None)."""
    return None if name is None else getattr(ms, name)


@contextlib.contextmanager
def in_mode(mode: int) -> Iterator[None]:
    """Run the block in ``mode`` (``ms.GRAPH_MODE`` / ``ms.PYNATIVE_MODE``); the caller's mode
    comes back, whatever the block raises."""
    previous = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        yield
    finally:
        ms.set_context(mode=previous)


def kept_on_model(model: nn.Cell, key: str, build: Callable[[], T]) -> T:
    """``build()``, kept on ``model`` under ``key`` and built anew once any of its cells has a
    newer stamp (surgery re-stamps what it touches, ``invalidate_compiled_graphs``; a new cell has
    a new stamp): Cells made over a model (generation steps, scoring graphs) keep their compiled
    graphs across the objects that use them, and never outlive a change of the model."""
    stamp = max(cell.create_time for _, cell in model.cells_and_names())
    kept_stamp, kept = model.__dict__.get(key, (None, None))
    if kept is None or kept_stamp != stamp:
        kept = build()
        # A plain attribute: as a Cell attribute the kept Cells (which hold the model) would be its children.
        object.__setattr__(model, key, (stamp, kept))
    return kept


def invalidate_compiled_graphs(model: nn.Cell) -> None:
    """Force the next call of ``model`` (or any of its cells) to recompile.

    MindSpore keys a Cell's compiled graph by (phase, create_time, id) and reads Python
    attributes of the tree as compile-time constants: after layer surgery, a merge, or an
    option change (``configure``), the cached graph is stale. This is mindqwen's one write to a
    private MindSpore attribute, and why: ``create_time`` is a read-only property over
    ``_create_time``, MindSpore 2.10 has no public way to drop a Cell's compiled graphs, and the
    public alternatives fail the user: a new Cell would leave the caller's reference (a notebook's
    ``model``) running the stale graph, and keying graphs on the options would not cover surgery.
    So every cell gets a new stamp. Decoder layers that changed get the compiled-once graph of
    their new signature (``sync_with_weights``).
    """
    stamp = time.time_ns()
    for _, cell in model.cells_and_names():
        if not hasattr(cell, "_create_time"):  # a MindSpore that renamed it would run stale graphs
            raise RuntimeError("this MindSpore has no Cell._create_time: mindqwen cannot invalidate compiled "
                               "graphs after changing a model (tests/test_lora.py checks this hook)")
        object.__setattr__(cell, "_create_time", stamp)
    sync_with_weights(model)


def sync_with_weights(model: nn.Cell) -> bool:
    """Let every cell of ``model`` that compiles by which weights train (or by its layers'
    settings) catch up with them: decoder layers whose signature changed (a weight frozen or
    thawed, an adapter, a precision) get the compiled-once graph of their new one, the loss
    forms the head's gradient only if the head trains. Returns whether anything changed: graphs
    compiled before then are stale, and callers that find a change invalidate them."""
    changed = [cell.sync_with_weights() for _, cell in model.cells_and_names() if hasattr(cell, "sync_with_weights")]
    return any(changed)


class CompiledOnceLayer(Protocol):
    """What ``share_layer_graphs`` asks of a decoder layer (an ``nn.Cell``; ``DecoderLayer`` is one)."""

    sparse: bool  # a mixture-of-experts layer: always inlined
    use_fused_ops: bool  # Ascend: marked for lazy_inline instead
    compiled_once: Optional[Callable]  # written here: the shared forward, None when inlined
    cached_once: Optional[Callable]  # written here: the shared KV-cache step, None when inlined
    signature: Optional[tuple]  # written here: the (signature, forward, cached) they were chosen for

    def weights(self) -> tuple: ...

    def apply(self, w, x, cos, sin, mask): ...

    def apply_cached(self, w, x, cos, sin, mask, k_cache, v_cache, cache_position): ...


def share_layer_graphs(layers, mode: Optional[bool] = None) -> bool:
    """Give dense layers the ``no_inline`` graphs of their signature, made from the first layer
    with that signature: the forward (``compiled_once``) where ``_shareable``, the KV-cache step
    (``cached_once``). ``mode`` True shares both, False neither, None (auto) the forward of layers
    with frozen weights (LoRA's training) and no KV-cache step: where the CPU's numbers favour it
    (docs/performance.md, "Time to first step"). Returns whether any layer's changed. On Ascend
    the layers are marked for ``lazy_inline`` instead, always. Called when the model is built,
    whenever its compiled graphs are invalidated (``invalidate_compiled_graphs``) and when a
    ``Stepper`` is built."""
    if layers and layers[0].use_fused_ops:
        return _mark_lazy_inline(layers)
    states = [_share_plan(layer, mode) for layer in layers]
    if all(layer.signature == state for layer, state in zip(layers, states)):
        return False
    graphs = {}
    for layer, (sig, forward, cached) in zip(layers, states):
        if sig is not None and sig not in graphs:
            graphs[sig] = _compile_once(layer)
        shared = graphs.get(sig, (None, None))
        layer.compiled_once, layer.cached_once = shared[0] if forward else None, shared[1] if cached else None
        layer.signature = (sig, forward, cached)
    return True


def _share_plan(layer: CompiledOnceLayer, mode: Optional[bool]) -> tuple:
    """(signature or None, share the forward, share the KV-cache step) for ``share_layer_graphs``."""
    if layer.sparse or mode is False:
        return None, False, False
    frozen = any(not p.requires_grad for p in layer.get_parameters())
    forward, cached = _shareable(layer) and (mode or frozen), bool(mode)
    return (layer_signature(layer) if forward or cached else None), forward, cached


def _mark_lazy_inline(layers) -> bool:
    """Ascend: what ``mindspore.lazy_inline`` does to a Cell, per layer: layers with equal keys
    compile to one reusable subgraph. (The decorator keys on the constructor's arguments, which
    hold the layer index; the signature is what makes two layers the same graph.) Verified on CPU
    only as far as the marking: the compile itself needs Ascend."""
    changed = False
    for layer in layers:
        key = "lazy_inline_DecoderLayer_" + hashlib.sha256(repr(layer_signature(layer)).encode()).hexdigest()[:16]
        changed = changed or getattr(layer, "cell_init_args", None) != key
        layer.cell_init_args = key
    return changed


def _shareable(layer: CompiledOnceLayer) -> bool:
    """Whether a dense layer's forward may be shared: not marked for recompute (recompute is a
    property of each layer's own graph). Its KV-cache step has no gradients and no such limit."""
    if layer.sparse or layer.use_fused_ops:
        return False
    return not any(getattr(cell, "_has_config_recompute", False) for _, cell in layer.cells_and_names())


def _compile_once(template: CompiledOnceLayer) -> tuple:
    """The ``no_inline`` forward and KV-cache step of the layers with ``template``'s signature.
    Frozen weights (LoRA's base) go through ``stop_gradient``: the shared backward is one graph
    for every caller, and would otherwise form their gradients for nothing (+24% step time, +26%
    memory at Qwen2.5-0.5B LoRA, benchmarks/no_inline_layer.py)."""
    frozen = tuple(not p.requires_grad for p in template.weights())

    @ms.no_inline
    def decoder_layer(x, cos, sin, mask, *w):
        w = tuple(ops.stop_gradient(t) if stop else t for t, stop in zip(w, frozen))
        return template.apply(w, x, cos, sin, mask)

    @ms.no_inline
    def decoder_layer_cached(x, cos, sin, mask, k_cache, v_cache, cache_position, *w):
        return template.apply_cached(w, x, cos, sin, mask, k_cache, v_cache, cache_position)
    return decoder_layer, decoder_layer_cached


# Cell attributes that are bookkeeping, MindSpore's or the grouping's own: they differ between
# layers that compute the same thing.
# ``training`` too: set_train sets it on the whole model, and MindSpore keys compiled graphs by it.
_BOOKKEEPING = frozenset({"is_top_cell", "arguments_key", "phase", "grad_ops_label", "cell_init_args",
                          "compiled_once", "cached_once", "signature", "training"})
_SETTING_TYPES = (bool, int, float, str, type(None), type(ms.float32).__mro__[-3])  # ... and MindSpore dtypes


def layer_signature(layer: nn.Cell) -> tuple:
    """Everything a layer's graph is compiled from except its weights' values: each sub-cell's
    type and settings, and each weight's shape, dtype and whether it trains. Two layers with
    equal signatures run the same graph."""
    parts = []
    for name, cell in layer.cells_and_names():
        settings = tuple(sorted((key, repr(value)) for key, value in vars(cell).items()
                                if not key.startswith("_") and key not in _BOOKKEEPING
                                and isinstance(value, _SETTING_TYPES)))
        weights = tuple((tuple(p.shape), str(p.dtype), p.requires_grad) for p in cell.get_parameters(expand=False))
        parts.append((name, type(cell), settings, weights))
    return tuple(parts)
