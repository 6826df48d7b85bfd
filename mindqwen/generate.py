"""Text generation.

Greedy decoding by full recomputation: each new token re-runs the whole sequence. Correct
and simple; a static-shape KV cache with prefill/decode graphs is the planned fast path.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from tqdm import tqdm

from mindqwen.models.qwen import QwenForCausalLM


def generate(model: QwenForCausalLM, input_ids, max_new_tokens: int = 32,
             eos_token_id=None, progress: bool = False) -> np.ndarray:
    """Greedy continuation of ``input_ids`` [B, S]; returns prompt + new tokens [B, S+N] int32.

    Rows stop growing after ``eos_token_id`` (they are padded with it) and generation ends
    when every row has stopped.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = np.asarray(input_ids.asnumpy() if isinstance(input_ids, ms.Tensor) else input_ids,
                     dtype=np.int32)
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, seq] with seq > 0, got shape {ids.shape}")
    stops = set(np.atleast_1d(eos_token_id).tolist()) if eos_token_id is not None else set()
    done = np.zeros(len(ids), dtype=bool)
    for _ in tqdm(range(max_new_tokens), desc="generating", unit="tok", disable=not progress):
        logits = model(ms.Tensor(ids))[:, -1].asnumpy()  # (B, V)
        nxt = logits.argmax(-1).astype(np.int32)
        if stops:
            nxt = np.where(done, next(iter(stops)), nxt)
            done |= np.isin(nxt, list(stops))
        ids = np.concatenate([ids, nxt[:, None]], 1)
        if done.all():
            break
    return ids
