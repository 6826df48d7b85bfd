"""The demo's own data: upper-casing letters, asked in English and in Chinese.

Pre-training text states the skill in a bare form (``upper k q z = K Q Z``); the instruction task
asks for it in a question/answer format the pre-trained model has never seen
(``Q: Upper-case the letters k q z. A:`` / ``问：把字母 k q z 变成大写。答：``). Before LoRA the
model does not answer in that format; after LoRA it does. Held-out questions use letter strings
drawn independently of the training ones, so they test the skill, not memory.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

Pair = Tuple[str, str]

# task → (bare form used in pre-training, English question, Chinese question, answer).
TASKS: Dict[str, Tuple[str, str, str, Callable[[str], str]]] = {
    "upper": ("upper", "Upper-case the letters", "变成大写", str.upper),
}
# Half the pre-training lines state single-digit sums ("3 + 5 = 8"). They are not asked about
# later; they shape the position-wise attention that copying needs. Measured: without them the
# tiny model's loss stayed at the unigram level for 1,600 steps (tasks copy, upper, lower in any
# mix); with them upper-casing is learnt in ~1,000 steps.
ARITHMETIC_SHARE = 0.5


@dataclass
class DemoData:
    pretrain: List[str]  # plain text lines
    train: List[Pair]  # (prompt, response)
    eval: List[Pair]


WORD_LENGTHS = (3, 5)  # letters per question (min, max)


def _letters(rng: random.Random, alphabet: int) -> str:
    return " ".join(rng.choice(string.ascii_lowercase[:alphabet]) for _ in range(rng.randint(*WORD_LENGTHS)))


def _question(task: str, letters: str, chinese: bool) -> Pair:
    _, en, zh, answer = TASKS[task]
    prompt = f"问：把字母 {letters} {zh}。答：" if chinese else f"Q: {en} {letters}. A:"
    return prompt, " " + answer(letters)


def make_demo_data(seed: int = 0, pretrain_lines: int = 6000, train_examples: int = 1200,
                   eval_examples: int = 120, alphabet: int = 26) -> DemoData:
    """Deterministic in ``seed``; half the questions are in Chinese; letters are the first
    ``alphabet`` of a–z."""
    rng = random.Random(seed)
    pretrain = []
    for _ in range(pretrain_lines):
        if rng.random() < ARITHMETIC_SHARE:
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            pretrain.append(f"{a} + {b} = {a + b}")
            continue
        name, _, _, answer = TASKS[rng.choice(list(TASKS))]
        letters = _letters(rng, alphabet)
        pretrain.append(f"{name} {letters} = {answer(letters)}")
    questions = [_question(rng.choice(list(TASKS)), _letters(rng, alphabet), rng.random() < 0.5)
                 for _ in range(train_examples + eval_examples)]
    return DemoData(pretrain, questions[:train_examples], questions[train_examples:])
