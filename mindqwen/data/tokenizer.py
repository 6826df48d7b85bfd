"""Tokenizers: a SentencePiece model (trained here for the demo, or the user's own).

``train_sentencepiece`` writes the model atomically (trained in a temporary folder, then moved),
so an interrupted run never leaves a half-written ``.model`` that later loads.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterable, List

# Fixed special ids so a trained tokenizer and the model config agree without bookkeeping.
UNK_ID, EOS_ID, PAD_ID = 0, 1, 2


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
        self.path = path
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.sp.get_piece_size()
        self.eos_token_id = self.sp.eos_id()
        self.pad_token_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_token_id
        if self.eos_token_id < 0:
            raise ValueError(f"{path}: the SentencePiece model has no end-of-sequence piece (eos_id)")

    def encode(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


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
