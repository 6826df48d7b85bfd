"""``mindqwen serve`` under load: N concurrent clients (the official ``openai`` client) against
the same requests sent one at a time, in one run. One JSON line.

The server runs in this process on a random-init model of ``--shape`` (bench-small by default)
with a byte-level tokenizer (ids = UTF-8 bytes), greedy, ``--new-tokens`` per request; every
client sends ``--requests`` completions with distinct prompts. Reported per mode: requests/s,
generated tokens/s, p50/p99 latency, p50/p99 time to first token (streamed), errors.

    python benchmarks/serve.py [--shape bench-small] [--clients 64] [--requests 2] [--new-tokens 32]
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

from train import SHAPES, shape_config


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


async def client(aclient, prompts, new_tokens, latencies, ttfts, tokens, errors):
    for prompt in prompts:
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


async def load(base, clients, requests, new_tokens):
    import openai
    aclient = openai.AsyncOpenAI(base_url=base, api_key="bench", max_retries=0, timeout=3600)
    latencies, ttfts, tokens, errors = [], [], [], []
    start = time.perf_counter()
    await asyncio.gather(*[client(aclient, [f"client {c} request {r}: tell me" for r in range(requests)],
                                  new_tokens, latencies, ttfts, tokens, errors) for c in range(clients)])
    seconds = time.perf_counter() - start
    await aclient.close()
    return {"clients": clients, "requests": clients * requests, "seconds": round(seconds, 2),
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
    args = ap.parse_args()
    import mindqwen
    from mindqwen.data.tokenizer import ByteTokenizer
    from mindqwen.generation import GenerationConfig, Generator
    from mindqwen.serve import Server
    model = mindqwen.QwenForCausalLM(mindqwen.QwenConfig(**shape_config(args.shape, args.layers)))
    generator = Generator(model, ByteTokenizer())
    server = Server(generator, port=0, max_batch_size=args.max_batch_size, max_queue=4 * args.clients * args.requests,
                    defaults=GenerationConfig(max_new_tokens=args.new_tokens)).start()
    base = f"http://{server.address[0]}:{server.address[1]}/v1"
    try:
        asyncio.run(load(base, 1, 1, args.new_tokens))  # compiles the graphs
        sequential = asyncio.run(load(base, 1, args.clients * args.requests // 4 or 1, args.new_tokens))
        concurrent = asyncio.run(load(base, args.clients, args.requests, args.new_tokens))
    finally:
        server.shutdown()
    print(json.dumps({"benchmark": "serve", "shape": args.shape, "new_tokens": args.new_tokens,
                      "max_batch_size": args.max_batch_size, "batching": "window",
                      "one_at_a_time": sequential, "concurrent": concurrent,
                      "throughput_ratio": round(concurrent["tokens_per_s"] / sequential["tokens_per_s"], 2),
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
