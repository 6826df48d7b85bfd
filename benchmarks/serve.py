"""``mindqwen serve`` under load, in one run, one JSON line. All against one server:

- ``one_at_a_time``: one client, requests back to back;
- under ``continuous`` batching (what ``mindqwen serve`` runs) and under ``window`` batching
  (what it ran before: ``WindowWorker``, a batch starts when the last one has ended and its first
  request waits up to 100 ms for company), three loads each:
  ``uniform``, ``--clients`` concurrent clients with ``--requests`` each of ``--new-tokens``;
  ``mixed``, the same with 1/4 to 2× ``--new-tokens`` per request;
  ``steady``, ``--steady`` single requests arriving at ``--rate`` per second.

The server runs in this process on a random-init model of ``--shape`` (bench-small by default)
with a byte-level tokenizer (ids = UTF-8 bytes), greedy, ``--new-tokens`` per request, distinct
prompts, the official ``openai`` client, streamed. Reported per mode: requests/s, generated
tokens/s, p50/p99 latency, p50/p99 time to first token, errors.

    python benchmarks/serve.py [--shape bench-small] [--clients 64] [--requests 2] [--new-tokens 32]
                               [--steady 200] [--rate 8]
"""
import argparse
import asyncio
import json
import queue
import sys
import time

from mindqwen.serve.worker import BatchWorker
from train import SHAPES, shape_config


class WindowWorker(BatchWorker):
    """Window batching, for comparison: admit only into an empty batch, after the first waiting
    request has waited up to ``window_s`` for company."""

    window_s = 0.1

    def _admit(self):
        if self.batch.active or not self.waiting:
            return []
        deadline = time.monotonic() + self.window_s
        while len(self.waiting) < self.max_batch and not self.stopping and time.monotonic() < deadline:
            try:
                job = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.stopping = job is None
            if job is not None:
                self.waiting.append(job)
        return super()._admit()


def compile_graphs(generator, max_rows, longest):
    """Compile the decode graph for every (rows, cache length) the loads can reach, so no mode
    pays for a compile another mode already paid for."""
    import numpy as np
    from mindspore import Tensor
    from mindqwen.generation import _rows_bucket, cache_length
    from mindqwen.models.kv_cache import CacheLayout
    lengths = sorted({cache_length(n) for n in range(1, longest + 1)})
    with generator.graph_mode():
        for rows in sorted({_rows_bucket(n, max_rows) for n in range(1, max_rows + 1)}):
            for length in lengths:
                zeros = Tensor(np.zeros((rows, 1), np.int32))
                cache = CacheLayout.of(generator.model.config, rows, length).zeros(generator.dtype)
                generator.decode(zeros, zeros, Tensor(np.zeros((rows, length), np.int32)), zeros, cache, cache)


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def client(aclient, prompts, lengths, latencies, ttfts, tokens, errors):
    for prompt, new_tokens in zip(prompts, lengths):
        start = time.perf_counter()
        try:
            stream = await aclient.completions.create(model="mindqwen", prompt=prompt, max_tokens=new_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens.append(chunk.usage.completion_tokens)
            latencies.append(time.perf_counter() - start)
            ttfts.append((first or time.perf_counter()) - start)
        except Exception as e:  # noqa: BLE001 - counted, not fatal: that is what is measured
            errors.append(type(e).__name__)


def lengths(new_tokens, client, requests, mixed):
    """``new_tokens`` for every request, or (mixed) 1/4 to 2× of it, spread evenly over clients."""
    return [new_tokens * (1 + (7 * client + 3 * r) % 8) // 4 if mixed else new_tokens for r in range(requests)]


async def load(base, clients, requests, new_tokens, rate=None, mixed=False):
    """``clients`` clients with ``requests`` each; with ``rate``, client c starts at c / rate s."""
    import openai
    aclient = openai.AsyncOpenAI(base_url=base, api_key="bench", max_retries=0, timeout=3600)
    latencies, ttfts, tokens, errors = [], [], [], []

    async def one(c):
        if rate:
            await asyncio.sleep(c / rate)
        await client(aclient, [f"client {c} request {r}: tell me" for r in range(requests)],
                     lengths(new_tokens, c, requests, mixed), latencies, ttfts, tokens, errors)
    start = time.perf_counter()
    await asyncio.gather(*[one(c) for c in range(clients)])
    seconds = time.perf_counter() - start
    await aclient.close()
    return {"clients": clients, "requests": clients * requests, "rate_per_s": rate, "seconds": round(seconds, 2),
            "requests_per_s": round(len(latencies) / seconds, 2), "tokens_per_s": round(sum(tokens) / seconds, 1),
            "latency_p50_s": round(percentile(latencies, 0.5), 3), "latency_p99_s": round(percentile(latencies, 0.99), 3),
            "ttft_p50_s": round(percentile(ttfts, 0.5), 3), "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
            "errors": len(errors), "error_types": sorted(set(errors))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="bench-small", choices=SHAPES)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--steady", type=int, default=200, help="requests at a steady rate (0: skip)")
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals per second in the steady mode")
    args = ap.parse_args()
    import mindqwen
    from mindqwen.data.tokenizer import ByteTokenizer
    from mindqwen.generation import GenerationConfig, Generator
    from mindqwen.serve import Server
    model = mindqwen.QwenForCausalLM(mindqwen.QwenConfig(**shape_config(args.shape, args.layers)))
    generator = Generator(model, ByteTokenizer())
    queued = max(4 * args.clients * args.requests, args.steady)
    server = Server(generator, port=0, max_batch_size=args.max_batch_size, max_queue=queued,
                    defaults=GenerationConfig(max_new_tokens=args.new_tokens)).start()
    base = f"http://{server.address[0]}:{server.address[1]}/v1"
    results = {}
    try:
        compile_graphs(generator, args.max_batch_size, 64 + 2 * args.new_tokens)  # prompts are < 64 bytes
        asyncio.run(load(base, 4, 1, args.new_tokens))  # and the prefill graph
        results["one_at_a_time"] = asyncio.run(load(base, 1, args.clients * args.requests // 4 or 1, args.new_tokens))
        for batching in ("continuous", "window"):
            if batching == "window":
                server.worker.stop()
                server.worker = WindowWorker(generator, args.max_batch_size, queued)
            results[batching] = {
                "uniform": asyncio.run(load(base, args.clients, args.requests, args.new_tokens)),
                "mixed": asyncio.run(load(base, args.clients, args.requests, args.new_tokens, mixed=True))}
            if args.steady:
                results[batching]["steady"] = asyncio.run(load(base, args.steady, 1, args.new_tokens, rate=args.rate))
    finally:
        server.shutdown()
    ratio = {kind: round(results["continuous"][kind]["tokens_per_s"] / results["window"][kind]["tokens_per_s"], 2)
             for kind in results["window"]}
    print(json.dumps({"benchmark": "serve", "shape": args.shape, "new_tokens": args.new_tokens,
                      "max_batch_size": args.max_batch_size, **results,
                      "continuous_vs_one_at_a_time": round(results["continuous"]["uniform"]["tokens_per_s"]
                                                           / results["one_at_a_time"]["tokens_per_s"], 2),
                      "continuous_vs_window_tokens_per_s": ratio,
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
