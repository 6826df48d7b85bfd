"""The demo's own data: upper-casing letters, asked in English and in Chinese.

Pre-training states the skill in a bare form (``upper k q z =`` → `` K Q Z``); the instruction task
asks for it in a question/answer format the pre-trained model has never seen
(``Q: Upper-case the letters k q z. A:`` / ``问：把字母 k q z 变成大写。答：``). Before LoRA the
model does not answer in that format; after LoRA it does. Held-out questions use letter strings
that no training question uses, so they test the skill, not memory.
"""
from __future__ import annotations

import json
import os
import random
import string
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

Pair = Tuple[str, str]

# task → (bare form used in pre-training, English question, Chinese question, answer).
TASKS: Dict[str, Tuple[str, str, str, Callable[[str], str]]] = {
    "upper": ("upper", "Upper-case the letters", "变成大写", str.upper),
}
# Pre-training puts the loss on the answers only. With packed text instead (loss on the random
# input letters too) the tiny model's copy circuit did not form within 1,600 steps (it stayed at
# the unigram loss); with answer-only loss it forms in ~400 steps.


@dataclass
class DemoData:
    pretrain: List[Pair]  # bare form: ("upper k q z =", " K Q Z")
    train: List[Pair]  # (prompt, response)
    eval: List[Pair]


WORD_LENGTHS = (3, 5)  # letters per question (min, max)


def _letters(rng: random.Random, alphabet: int, lengths: Tuple[int, int] = WORD_LENGTHS) -> str:
    return " ".join(rng.choice(string.ascii_lowercase[:alphabet]) for _ in range(rng.randint(*lengths)))


def _question(task: str, letters: str, chinese: bool) -> Pair:
    _, en, zh, answer = TASKS[task]
    prompt = f"问：把字母 {letters} {zh}。答：" if chinese else f"Q: {en} {letters}. A:"
    return prompt, " " + answer(letters)


def make_demo_data(seed: int = 0, pretrain_examples: int = 6000, train_examples: int = 1200,
                   eval_examples: int = 120, alphabet: int = 26,
                   word_lengths: Tuple[int, int] = WORD_LENGTHS) -> DemoData:
    """Deterministic in ``seed``; half the questions are in Chinese; letters are the first
    ``alphabet`` of a–z; the questions (not the bare form) ask for ``word_lengths`` letters."""
    rng = random.Random(seed)
    pretrain = []
    for _ in range(pretrain_examples):
        name, _, _, answer = TASKS[rng.choice(list(TASKS))]
        letters = _letters(rng, alphabet)
        pretrain.append((f"{name} {letters} =", " " + answer(letters)))
    train_letters = [_letters(rng, alphabet, word_lengths) for _ in range(train_examples)]
    seen, eval_letters = set(train_letters), []
    while len(eval_letters) < eval_examples:  # held out: no letter string of the training questions
        letters = _letters(rng, alphabet, word_lengths)
        if letters not in seen:
            eval_letters.append(letters)
            seen.add(letters)
    train, held_out = ([_question(rng.choice(list(TASKS)), letters, rng.random() < 0.5) for letters in split]
                       for split in (train_letters, eval_letters))
    return DemoData(pretrain, train, held_out)


def write_letters(section, folder: str) -> Dict[str, str]:
    """Write the demo's three splits (``folder/{pretrain,train,eval}.jsonl``) and a SentencePiece
    tokenizer trained on them (``folder/tokenizer.model``), as a user would bring them.

    Args:
        section: a recipe's ``data.synthetic`` (seed, split sizes, alphabet, vocab_size).

    Returns:
        The paths, by ``data`` key: train, eval, pretrain, tokenizer.
    """
    from mindqwen.data.instruct import write_pairs
    from mindqwen.data.tokenizer import train_sentencepiece
    demo = make_demo_data(section.seed, section.pretrain_examples, section.train_examples, section.eval_examples,
                          section.alphabet, tuple(section.word_lengths))
    os.makedirs(folder, exist_ok=True)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("pretrain", "train", "eval")}
    for name, pairs in (("pretrain", demo.pretrain), ("train", demo.train), ("eval", demo.eval)):
        write_pairs(pairs, paths[name])
    paths["tokenizer"] = os.path.join(folder, "tokenizer.model")
    train_sentencepiece([p + r for p, r in demo.pretrain + demo.train], paths["tokenizer"], section.vocab_size)
    return paths


def near_miss(answer: str, rng: random.Random, alphabet: int = 26) -> str:
    """The answer with the mistakes a small model makes: one letter dropped, repeated or replaced
    by another (" K Q Z" → " K Z", " K Q Q Z", " K J Z"); what a preference stage trains away."""
    letters = answer.split()
    i = rng.randrange(len(letters))
    kind = rng.choice(("drop", "repeat", "replace") if len(letters) > 1 else ("repeat", "replace"))
    if kind == "drop":
        del letters[i]
    elif kind == "repeat":
        letters.insert(i, letters[i])
    else:
        letters[i] = rng.choice([c for c in string.ascii_uppercase[:alphabet] if c != letters[i]])
    return " " + " ".join(letters)


def write_letter_pairs(section, folder: str) -> Dict[str, str]:
    """The demo's questions as preference pairs (``folder/{train,eval}.jsonl``: prompt, the right
    answer chosen, a near miss rejected: ``near_miss``), for the model the letters demo trained.

    Args:
        section: a recipe's ``data.synthetic`` (the seed, split sizes and alphabet of that run).

    Returns:
        The paths, by ``data`` key: train, eval.
    """
    demo = make_demo_data(section.seed, section.pretrain_examples, section.train_examples, section.eval_examples,
                          section.alphabet, tuple(section.word_lengths))
    rng = random.Random(section.seed + 1)
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, pairs in (("train", demo.train), ("eval", demo.eval)):
        paths[name] = os.path.join(folder, f"{name}.jsonl")
        with open(paths[name], "w", encoding="utf-8") as f:
            for prompt, answer in pairs:
                record = {"prompt": prompt, "chosen": answer, "rejected": near_miss(answer, rng, section.alphabet)}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return paths
