"""The requests ``benchmarks/harness.py`` scores, drawn the same way in either framework's process
(numpy only): lists of (None, context ids, continuation ids), the form a harness backend's
``_loglikelihood_tokens`` takes."""
import numpy as np


def requests(kind: str, vocab: int, n: int, length: int = 256) -> list:
    """``uniform``: n rows of ``length`` tokens, each its own context (6-token continuations);
    ``choice``: n // 4 questions of a 64-token context, each with four 4-12 token answers."""
    rng = np.random.default_rng(1234)
    if kind == "uniform":
        rows = rng.integers(0, vocab, (n, length))
        return [(None, r[:-6].tolist(), r[-6:].tolist()) for r in rows]
    out = []
    for _ in range(n // 4):
        context = rng.integers(0, vocab, 64).tolist()
        out += [(None, context, rng.integers(0, vocab, int(rng.integers(4, 13))).tolist()) for _ in range(4)]
    return out
