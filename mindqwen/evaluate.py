"""Exact-match accuracy of greedy answers on held-out prompt/response pairs."""
from __future__ import annotations

from collections import defaultdict
from typing import List, Sequence, Tuple

import numpy as np

from mindqwen.generate import generate

Pair = Tuple[str, str]


def answer(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 16) -> List[str]:
    """Greedy answers, decoded up to the first EOS. Prompts of equal token length share a batch
    (no padding needed, and one compiled shape per length)."""
    encoded = [tokenizer.encode(p) for p in prompts]
    groups = defaultdict(list)
    for i, ids in enumerate(encoded):
        groups[len(ids)].append(i)
    answers = [""] * len(prompts)
    was_training = model.training
    model.set_train(False)
    for length, rows in groups.items():
        out = generate(model, np.array([encoded[i] for i in rows]), max_new_tokens, tokenizer.eos_token_id)
        for i, new in zip(rows, out[:, length:].tolist()):
            if tokenizer.eos_token_id in new:
                new = new[:new.index(tokenizer.eos_token_id)]
            answers[i] = tokenizer.decode(new)
    model.set_train(was_training)
    return answers


def exact_match(model, tokenizer, pairs: Sequence[Pair], max_new_tokens: int = 16) -> Tuple[float, List[str]]:
    """(fraction of answers equal to the reference after stripping whitespace, the answers)."""
    answers = answer(model, tokenizer, [p for p, _ in pairs], max_new_tokens)
    hits = sum(a.strip() == r.strip() for a, (_, r) in zip(answers, pairs))
    return hits / len(pairs), answers
