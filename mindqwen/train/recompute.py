"""Activation recompute (gradient checkpointing) by decoder layer, from the trainer config."""
from mindspore import nn

from mindqwen.models.graph import invalidate_compiled_graphs
from mindqwen.models.qwen import DecoderLayer


def apply_recompute(model: nn.Cell, mode: str, every: int = 1) -> int:
    """Mark the decoder layers of ``model`` (a causal LM, or any Cell holding one, such as a fused
    multimodal model), or their attention / MLP, for recompute in the backward pass.

    Args:
        mode: none | full (the whole layer) | attention | mlp.
        every: only layers whose index is a multiple of ``every``.

    Returns:
        The number of cells marked.
    """
    if mode == "none":
        return 0
    layers = [cell for _, cell in model.cells_and_names() if isinstance(cell, DecoderLayer)]
    for layer in layers[::every]:
        {"full": layer, "attention": layer.mixer, "mlp": layer.mlp}[mode].recompute()
    invalidate_compiled_graphs(model)  # a recomputed layer is inlined (share_layer_graphs)
    return len(layers[::every])
