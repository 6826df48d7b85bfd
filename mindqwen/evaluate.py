"""Exact-match accuracy of greedy answers on held-out prompt/response pairs."""
from __future__ import annotations

from typing import List, Sequence, Tuple

from mindqwen.generation import GenerationConfig, Generator

Pair = Tuple[str, str]


def answer(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 16,
           batch_size: int = 64) -> List[str]:
    """Greedy answers, decoded up to the first EOS; prompts are left-padded into batches of
    equal rows (at most ``batch_size``; the last one's free rows masked out), which run one
    compiled decode graph per cache-length bucket."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    encoded = [tokenizer.encode(p) for p in prompts]
    if not encoded:
        return []
    config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
    was_training = model.training  # before the Generator puts the model in inference mode
    generator = Generator(model)
    size = -(-len(encoded) // -(-len(encoded) // batch_size))  # 120 prompts at 64: two batches of 60
    answers: List[str] = []
    for start in range(0, len(encoded), size):
        for row in generator.run(encoded[start:start + size], config, rows=size):
            answers.append(tokenizer.decode([t for t in row.tokens if t != tokenizer.eos_token_id]))
    model.set_train(was_training)
    return answers


def exact_match(model, tokenizer, pairs: Sequence[Pair], max_new_tokens: int = 16) -> Tuple[float, List[str]]:
    """(fraction of answers equal to the reference after stripping whitespace, the answers)."""
    answers = answer(model, tokenizer, [p for p, _ in pairs], max_new_tokens)
    hits = sum(a.strip() == r.strip() for a, (_, r) in zip(answers, pairs))
    return hits / len(pairs), answers
