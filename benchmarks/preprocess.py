"""Preprocessing throughput: `mindqwen preprocess` with 1 and N workers next to HF `tokenizers`.

A byte-level BPE with Qwen2's pre-tokenizer (vocab 8,000) is trained with HF `tokenizers` on a
synthetic mixed corpus (English, Chinese, code, digits, emoji); both sides use that vocabulary.
Prints one JSON line: tokens/s of the full preprocess (JSON parse, tokenize, pack, write) for 1
and N workers, of mindqwen's tokenizer alone (tiktoken core, one thread), and of HF
`tokenizers` ``encode_batch`` (Rust, all threads) as the baseline.

    python benchmarks/preprocess.py [--docs 20000] [--workers 2]   (needs: pip install tokenizers)
"""
import argparse
import json
import os
import random
import tempfile
import time


def corpus(n: int, seed: int = 0):
    rng = random.Random(seed)
    words = ["model", "training", "数据", "模型", "学习", "def", "return", "self.x", "😀", "🚀", "2024", "3.14",
             "Qwen", "MindSpore", "attention", "梯度", "优化器", "batch", "    ", "\n"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(50, 400))) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from mindqwen.data.preprocess import preprocess
    from mindqwen.data.tokenizer import QWEN2_PATTERN, QwenTokenizer
    docs = corpus(args.docs)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Tokenizer(models.BPE())
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_PATTERN), "isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        hf.train_from_iterator(docs[:2000], trainers.BpeTrainer(vocab_size=8000, show_progress=False,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        hf.add_special_tokens(["<|endoftext|>"])
        hf.save(os.path.join(tmp, "tokenizer.json"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|endoftext|>"}, f)
        path = os.path.join(tmp, "docs.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
        ours = QwenTokenizer.from_pretrained(tmp)
        t = time.perf_counter()
        tokens = sum(len(ids) for ids in ours.encode_batch(docs, num_threads=1))
        ours_s = time.perf_counter() - t
        t = time.perf_counter()
        hf_tokens = sum(len(e.ids) for e in hf.encode_batch(docs))
        hf_s = time.perf_counter() - t
        assert hf_tokens == tokens, (hf_tokens, tokens)
        rates = {}
        for workers in sorted({1, args.workers}):
            t = time.perf_counter()
            s = preprocess([path], os.path.join(tmp, f"out{workers}"), tmp, 2048, "text", workers, progress=False)
            rates[workers] = s.tokens / (time.perf_counter() - t)
    print(json.dumps({"benchmark": "preprocess", "docs": args.docs, "tokens": tokens,
                      **{f"preprocess_tokens_per_s_{w}_workers": round(r) for w, r in rates.items()},
                      "mindqwen_tokenizer_tokens_per_s_1_thread": round(tokens / ours_s),
                      "hf_tokenizers_encode_batch_tokens_per_s": round(tokens / hf_s), "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
