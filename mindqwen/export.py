"""MindIR export of the prefill graph, with a parity check of the exported graph.

The graph takes a left-padded batch ``input_ids, attention_mask`` (B, S) int32 and returns the
next-token logits (B, V) fp32 at the last position. The KV-cache decode graph and the
``converter_lite`` configs for Ascend 310 come with the deployment work.
"""
from __future__ import annotations

import os
import tempfile

import mindspore as ms
import numpy as np
from mindspore import nn

from mindqwen.models.qwen import QwenForCausalLM


class Prefill(nn.Cell):
    def __init__(self, model: QwenForCausalLM):
        super().__init__(auto_prefix=False)
        self.model = model

    def construct(self, input_ids, attention_mask):
        logits = self.model(input_ids, attention_mask)  # (B, S, V)
        return logits[:, -1].astype(ms.float32)  # (B, V)


def export_mindir(model: QwenForCausalLM, path: str, batch_size: int = 1, seq_length: int = 64) -> float:
    """Write the prefill graph to ``path`` (``*.mindir``) atomically; returns the largest absolute
    logit difference between the exported graph and the eager model on a random padded batch."""
    if not path.endswith(".mindir"):
        raise ValueError(f"MindIR path must end with .mindir, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    net = Prefill(model)
    net.set_train(False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, (batch_size, seq_length)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :seq_length // 4] = 0  # one left-padded row exercises the mask path
    inputs = (ms.Tensor(ids), ms.Tensor(mask))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        staged = os.path.join(tmp, "graph")
        ms.export(net, *inputs, file_name=staged, file_format="MINDIR")  # appends .mindir
        exported = nn.GraphCell(ms.load(staged + ".mindir"))(*inputs).asnumpy()
        eager = net(*inputs).asnumpy()
        os.replace(staged + ".mindir", path)
    return float(np.abs(exported - eager).max())
