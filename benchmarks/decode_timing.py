"""The decode figures of a benchmark pair (benchmarks/qwen3_5.py and its peer, which runs in another
virtualenv: plain Python, nothing imported but the standard library)."""
import statistics


def decode_figures(calls: list, batch: int, new_tokens: int, warmup: int) -> dict:
    """The decode figures from each call's (call, prefill, decode) seconds, ``warmup`` calls left out of the
    medians (the first call compiles)."""
    call, pre, dec = (statistics.median(c[k] for c in calls[warmup:]) for k in range(3))
    return dict(decode_tokens_per_s=round(batch * (new_tokens - 1) / dec, 1),
                ms_per_decode_step=round(dec / (new_tokens - 1) * 1e3, 2),
                tokens_per_s=round(batch * new_tokens / call, 1), gen_ms=round(call * 1e3, 1),
                prefill_s=round(pre, 3), first_call_s=round(calls[0][0], 2), first_token_s=round(calls[0][1], 2),
                compile_s=round(calls[0][0] - call, 2),
                decode_ms_all=[round(c[2] * 1e3) for c in calls], prefill_ms_all=[round(c[1] * 1e3) for c in calls])
