"""Activation recompute (gradient checkpointing) by layer, from the trainer config."""
from mindspore import nn


def apply_recompute(model: nn.Cell, mode: str, every: int = 1) -> int:
    """Mark decoder layers (or their attention / MLP) for recompute in the backward pass.

    Args:
        mode: none | full (the whole layer) | attention | mlp.
        every: only layers whose index is a multiple of ``every``.

    Returns:
        The number of cells marked.
    """
    if mode == "none":
        return 0
    marked = 0
    for i, layer in enumerate(model.model.layers):
        if i % every:
            continue
        target = {"full": layer, "attention": layer.self_attn, "mlp": layer.mlp}[mode]
        target.recompute()
        marked += 1
    return marked
