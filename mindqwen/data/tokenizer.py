"""Tokenizers: Qwen's byte-level BPE (on tiktoken's core) and SentencePiece.

``QwenTokenizer`` reads an HF folder (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``, with
``tokenizer_config.json`` for the added tokens) or Qwen-1's ``qwen.tiktoken``. HF's Qwen2
tokenizer is NFC normalisation → split by ``QWEN2_PATTERN`` → byte-level BPE; tiktoken runs the
same split and BPE natively (Qwen's vocabulary was born a tiktoken one, so merge order = rank).

``train_sentencepiece`` writes the model atomically (trained in a temporary folder, then moved),
so an interrupted run never leaves a half-written ``.model`` that later loads.
"""
from __future__ import annotations

import base64
import os
import shutil
import tempfile
import unicodedata
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from mindqwen.io.jsonfile import read_json

# Fixed special ids so a trained tokenizer and the model config agree without bookkeeping.
UNK_ID, EOS_ID, PAD_ID = 0, 1, 2

# Qwen2 / Qwen2.5 / Qwen3 pre-tokenisation (tokenizer.json "pre_tokenizer" Split pattern).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen-1 (qwen.tiktoken): digits one at a time as well, no NFC.
QWEN1_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]


def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's byte → printable character map that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class QwenTokenizer:
    """Qwen's tokenizer: ``encode``, ``encode_batch``, ``decode`` and a streaming decoder.

    Args:
        ranks: token bytes → id (the BPE vocabulary, merge order = id order).
        added: added-token text → id (``<|im_start|>``, ``<think>``, …); matched whole in the text.
        eos_token: the token that ends generation / separates packed documents.
        pad_token: fills rows (defaults to eos).
        nfc: NFC-normalise text first (Qwen2+; Qwen-1 does not).
        special: the added tokens that are control tokens (``decode(..., skip_special_tokens=True)``
            leaves them out); None: all of them.
    """

    def __init__(self, ranks: Dict[bytes, int], added: Dict[str, int], eos_token: str,
                 pad_token: Optional[str] = None, nfc: bool = True, name: str = "qwen",
                 special: Optional[Iterable[str]] = None):
        import tiktoken
        self.encoding = tiktoken.Encoding(name, pat_str=QWEN2_PATTERN, mergeable_ranks=ranks, special_tokens=added)
        self.added, self.nfc, self.name = added, nfc, name
        self.id_to_added = {i: t for t, i in added.items()}
        self.special_ids = frozenset(added[t] for t in (added if special is None else special))
        for token in (eos_token, pad_token or eos_token):
            if token not in added:
                raise ValueError(f"special token {token!r} is not among the added tokens")
        self.eos_token_id = added[eos_token]
        self.pad_token_id = added[pad_token or eos_token]
        self.vocab_size = max(max(ranks.values()), max(added.values(), default=0)) + 1

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, folder: str) -> "QwenTokenizer":
        """An HF tokenizer folder: tokenizer.json, or vocab.json + merges.txt (+ tokenizer_config.json)."""
        if os.path.isfile(os.path.join(folder, "qwen.tiktoken")):
            return cls.from_tiktoken_file(os.path.join(folder, "qwen.tiktoken"))
        config_path = os.path.join(folder, "tokenizer_config.json")
        config = read_json(config_path, ValueError, "tokenizer config") if os.path.isfile(config_path) else {}
        entries = [dict(v, id=int(k)) for k, v in config.get("added_tokens_decoder", {}).items()]
        tok_json = os.path.join(folder, "tokenizer.json")
        if os.path.isfile(tok_json):
            spec = read_json(tok_json, ValueError, "tokenizer.json")
            vocab = spec.get("model", {}).get("vocab")
            if not isinstance(vocab, dict):
                raise ValueError(f"{tok_json}: no BPE model.vocab")
            entries += spec.get("added_tokens", [])
        else:
            vocab = read_json(os.path.join(folder, "vocab.json"), ValueError, "vocab.json (or tokenizer.json)")
        added = {t["content"]: t["id"] for t in entries}
        special = {t["content"] for t in entries if t.get("special", True)}
        decoder = {c: b for b, c in bytes_to_unicode().items()}
        try:
            ranks = {bytes(decoder[c] for c in token): i for token, i in vocab.items() if token not in added}
        except KeyError as e:
            raise ValueError(f"{folder}: vocabulary token with character {e} is not byte-level BPE") from None
        eos = config.get("eos_token") or "<|endoftext|>"
        eos = eos["content"] if isinstance(eos, dict) else eos
        pad = config.get("pad_token")
        pad = pad["content"] if isinstance(pad, dict) else pad
        return cls(ranks, added, eos, pad, nfc=True, name=os.path.basename(os.path.abspath(folder)), special=special)

    @classmethod
    def from_tiktoken_file(cls, path: str) -> "QwenTokenizer":
        """Qwen-1's ``qwen.tiktoken`` (base64 token, rank per line)."""
        ranks = {}
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        token, rank = line.split()
                        ranks[base64.b64decode(token)] = int(rank)
                    except ValueError:
                        raise ValueError(f"{path}:{n}: expected '<base64 token> <rank>'") from None
        added = {t: len(ranks) + i for i, t in enumerate(QWEN1_SPECIAL)}
        return cls(ranks, added, "<|endoftext|>", nfc=False, name="qwen1")

    # ------------------------------------------------------------------ use
    def encode(self, text: str, allowed_special: Union[str, Sequence[str]] = "all",
               disallowed_special: Union[str, Sequence[str]] = ()) -> List[int]:
        """Ids of ``text``. Added tokens in the text are matched whole when allowed ("all", a list
        of them, or "none"); the others are encoded as ordinary characters, unless listed in
        ``disallowed_special`` ("all" or a list): then their presence raises ValueError (for
        untrusted text that must not inject control tokens)."""
        allowed, disallowed = self._special_sets(allowed_special, disallowed_special)
        try:
            return self.encoding.encode(unicodedata.normalize("NFC", text) if self.nfc else text,
                                        allowed_special=allowed, disallowed_special=disallowed)
        except ValueError as e:  # tiktoken: "Encountered text corresponding to disallowed special token ..."
            raise ValueError(str(e).splitlines()[0]) from None

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[int]]:
        """(ids, the character offset in ``text`` where each token starts)."""
        ids = self.encode(text)
        return ids, list(self.encoding.decode_with_offsets(ids)[1])

    def encode_batch(self, texts: Sequence[str], allowed_special: Union[str, Sequence[str]] = "all",
                     disallowed_special: Union[str, Sequence[str]] = (), num_threads: int = 8) -> List[List[int]]:
        """``encode`` of every text, on ``num_threads`` threads (tiktoken releases the GIL)."""
        if self.nfc:
            texts = [unicodedata.normalize("NFC", t) for t in texts]
        allowed, disallowed = self._special_sets(allowed_special, disallowed_special)
        try:
            return self.encoding.encode_batch(list(texts), num_threads=num_threads, allowed_special=allowed,
                                              disallowed_special=disallowed)
        except ValueError as e:
            raise ValueError(str(e).splitlines()[0]) from None

    def _special_sets(self, allowed_special, disallowed_special):
        allowed = self._special_set(allowed_special)
        return allowed, self._special_set(disallowed_special) - allowed

    def _special_set(self, spec: Union[str, Sequence[str]]) -> set:
        if spec == "all":
            return set(self.added)
        if spec == "none":
            return set()
        unknown = set(spec) - set(self.added)
        if unknown:
            raise ValueError(f"not added tokens of this tokenizer: {sorted(unknown)}")
        return set(spec)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.encoding.decode_bytes([int(i) for i in ids])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; an incomplete UTF-8 sequence becomes U+FFFD (as HF does).
        ``skip_special_tokens``: leave the control tokens out (``special_ids``)."""
        if skip_special_tokens:
            ids = [i for i in ids if int(i) not in self.special_ids]
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental decoding for generation: ``push(id)`` returns the text that is complete so far,
    holding back the bytes of a character whose UTF-8 sequence is still unfinished."""

    def __init__(self, tokenizer: QwenTokenizer):
        self.tokenizer, self.pending = tokenizer, b""

    def push(self, token_id: int) -> str:
        self.pending += self.tokenizer.decode_bytes([token_id])
        cut = len(self.pending)
        for back in range(1, min(4, len(self.pending)) + 1):  # an unfinished sequence is at most 3 bytes
            byte = self.pending[-back]
            if byte & 0xC0 == 0xC0:  # a lead byte: is its sequence complete?
                need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
                cut = len(self.pending) - back if back < need else len(self.pending)
                break
            if byte & 0x80 == 0:
                break
        text, self.pending = self.pending[:cut].decode("utf-8", errors="replace"), self.pending[cut:]
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text


class SentencePieceTokenizer:
    """Text ⇄ ids through a SentencePiece ``.model`` file.

    Attributes:
        vocab_size: number of pieces (the model's ``vocab_size`` must be at least this).
        eos_token_id, pad_token_id: ends a sequence / fills a row.
    """

    def __init__(self, path: str):
        import sentencepiece as spm
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: tokenizer model not found")
        self.path, self.name = path, os.path.basename(path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"{path}: not a SentencePiece model ({str(e).splitlines()[0]})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eos_token_id = self.sp.eos_id()
        self.pad_token_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_token_id
        if self.eos_token_id < 0:
            raise ValueError(f"{path}: the SentencePiece model has no end-of-sequence piece (eos_id)")

    def encode(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[int]]:
        """(ids, the character offset in ``text`` where each token starts)."""
        pieces = self.sp.encode(text, out_type="proto").pieces  # begin: a UTF-8 byte offset
        char_starts = np.cumsum([0] + [len(c.encode("utf-8")) for c in text])  # byte offset of each char
        starts = np.searchsorted(char_starts, [p.begin for p in pieces], side="right") - 1
        return [p.id for p in pieces], starts.tolist()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids past the pieces (a model's padded vocabulary rows) decode to nothing,
        and so do control pieces (eos, pad) whatever ``skip_special_tokens`` says."""
        return self.sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


class ByteTokenizer:
    """UTF-8 bytes are the ids (an id above 255 wraps to its byte); id 0 ends a text. For
    smoke tests and load benchmarks of models without a tokenizer of their own."""

    eos_token_id = 0

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def load_tokenizer(path: str) -> Union[QwenTokenizer, SentencePieceTokenizer]:
    """A Qwen tokenizer folder (or ``qwen.tiktoken``), or a SentencePiece ``.model``."""
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    return QwenTokenizer.from_tiktoken_file(path) if path.endswith(".tiktoken") else QwenTokenizer.from_pretrained(path)


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "qwen.tiktoken", "tokenizer.model")


def model_tokenizer(folder: Optional[str], path: Optional[str] = None, required: bool = True):
    """The tokenizer at ``path`` if given, else the one in the model ``folder`` (any of
    ``TOKENIZER_FILES``); None when there is none and it is not ``required``.

    Raises:
        ValueError: ``required`` and neither gives one.
    """
    if path is not None:
        return load_tokenizer(path)
    if folder is not None and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        sentencepiece = os.path.join(folder, "tokenizer.model")
        return load_tokenizer(sentencepiece if os.path.isfile(sentencepiece) else folder)
    if required:
        where = f"{folder} has no tokenizer ({', '.join(TOKENIZER_FILES)})" if folder else "no tokenizer was given"
        raise ValueError(f"this needs a tokenizer and {where}: give one with --tokenizer (an HF tokenizer "
                         "folder, qwen.tiktoken or a SentencePiece .model)")
    return None


def train_sentencepiece(lines: Iterable[str], path: str, vocab_size: int) -> SentencePieceTokenizer:
    """Train a BPE SentencePiece model on ``lines`` and write it to ``path`` (``*.model``).

    Digits are split one per piece (numbers then tokenise uniformly), characters are fully
    covered (Chinese included), and there is no BOS: ids 0/1/2 are unk/eos/pad.
    """
    import sentencepiece as spm
    if not path.endswith(".model"):
        raise ValueError(f"tokenizer path must end with .model, got {path!r}")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
        try:
            spm.SentencePieceTrainer.train(
                input=corpus, model_prefix=os.path.join(tmp, "tok"), vocab_size=vocab_size, model_type="bpe",
                split_digits=True, character_coverage=1.0, unk_id=UNK_ID, eos_id=EOS_ID, pad_id=PAD_ID,
                bos_id=-1, minloglevel=2)
        except RuntimeError as e:  # e.g. "Vocabulary size too high (N). Please set it to a value <= M."
            raise ValueError(f"training the tokenizer {path}: {str(e).split('] ')[-1]}") from None
        shutil.move(os.path.join(tmp, "tok.model"), path)
    return SentencePieceTokenizer(path)
