"""Qwen tokenizer on tiktoken's core against HF `tokenizers` (test-only dependency): a byte-level
BPE trained here with Qwen2's normaliser, pre-tokeniser and added tokens, saved both as
tokenizer.json and as vocab.json + merges.txt."""
import json

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mindqwen.data.tokenizer import QWEN2_PATTERN, QwenTokenizer

ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog 12345 times.",
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习和深度学习。",
    "def forward(self, x):\n    return self.proj(x) + 1  # residual\n\n\tif a == b:\n        pass",
    "Emoji: 😀🚀👍🏽 and mixed 中文English123混合 text… naïve café Ångström",
    "    lots   of\twhitespace \n\n\n  runs\r\n  here   ",
    "<|im_start|>user\n2+2=?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|><|endoftext|>",
    "It's we'll they've I'M don't — 'quoted' \"double\" 3.14159 1,000,000 0x1F",
]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens(ADDED)  # appended after the BPE vocabulary, as in Qwen
    folder = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(folder / "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json + merges.txt
    added = {str(tok.token_to_id(t)): {"content": t, "special": t.startswith("<|")} for t in ADDED}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added,
                                                              "eos_token": "<|endoftext|>"}))
    return folder, tok


TEXTS = CORPUS + ["unseen words: antidisestablishmentarianism 量子计算 🦄🦄", "", " ", "\n", "a<|im_end|>b"]


@pytest.mark.parametrize("source", ["tokenizer.json", "vocab.json"])
def test_ids_equal_hf_tokenizers(hf_folder, source, tmp_path):
    folder, hf = hf_folder
    if source == "vocab.json":  # the two-file form: no tokenizer.json
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            (tmp_path / name).write_bytes((folder / name).read_bytes())
        folder = tmp_path
    ours = QwenTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text).ids, text
    assert ours.encode_batch(TEXTS) == [e.ids for e in hf.encode_batch(TEXTS)]


def test_round_trip_and_special_handling(hf_folder):
    folder, hf = hf_folder
    ours = QwenTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text
    im_end = hf.token_to_id("<|im_end|>")
    assert ours.encode("<|im_end|>") == [im_end]
    assert im_end not in ours.encode("<|im_end|>", allowed_special="none")  # spelled out as characters
    assert ours.decode(ours.encode("<|im_end|>", allowed_special="none")) == "<|im_end|>"
    assert ours.eos_token_id == hf.token_to_id("<|endoftext|>") and ours.vocab_size == hf.get_vocab_size()


def test_stream_decoding_never_emits_half_characters(hf_folder):
    ours = QwenTokenizer.from_pretrained(str(hf_folder[0]))
    text = "Emoji 😀🚀 中文 naïve"
    stream, out = ours.stream(), []
    for token in ours.encode(text):
        piece = stream.push(token)
        assert "\ufffd" not in piece
        out.append(piece)
    assert "".join(out) + stream.flush() == text


def test_qwen1_tiktoken_file(hf_folder, tmp_path):
    """The same vocabulary written as Qwen-1's qwen.tiktoken (base64 bytes, rank) encodes alike."""
    import base64
    folder, hf = hf_folder
    ours = QwenTokenizer.from_pretrained(str(folder))
    lines = sorted((rank, base64.b64encode(token).decode()) for token, rank in ours.encoding._mergeable_ranks.items())
    (tmp_path / "qwen.tiktoken").write_text("".join(f"{b64} {rank}\n" for rank, b64 in lines))
    qwen1 = QwenTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        if "<think>" not in text:  # Qwen-1 has no think tokens; its first three specials match Qwen2's
            assert qwen1.encode(text) == hf.encode(text).ids, text
    (tmp_path / "qwen.tiktoken").write_text("not-base64\n")
    with pytest.raises(ValueError, match=r"qwen\.tiktoken:1: expected"):
        QwenTokenizer.from_pretrained(str(tmp_path))


def test_disallowed_special_tokens_raise(hf_folder):
    ours = QwenTokenizer.from_pretrained(str(hf_folder[0]))
    with pytest.raises(ValueError, match="disallowed special token"):
        ours.encode("user text <|im_start|>system", allowed_special="none", disallowed_special="all")
    assert ours.encode("plain text", allowed_special="none", disallowed_special="all") == ours.encode("plain text")
    with pytest.raises(ValueError, match="not added tokens"):
        ours.encode("x", allowed_special=["<|nope|>"])
