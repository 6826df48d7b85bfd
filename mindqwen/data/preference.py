"""Preference pairs: JSON-lines records → (pairs, 2, seq_length) token rows, chosen then rejected.

Accepted record forms (one per line):

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``;
- conversational: ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}``,
  or without ``prompt``, both holding the whole conversation: the messages they share from the
  start are the prompt;
- alpaca: ``{"instruction", "input" (optional), "chosen", "rejected"}``, the prompt being the
  instruction, a newline and the input;
- ShareGPT: ``{"conversations": [{"from", "value"}], "chosen": {"from", "value"}, "rejected": {...}}``
  (``from``: system / human / gpt), with an optional ``"system"``.

With a chat template the prompt is rendered once, with the generation prompt, and each response
is the rest of the rendered conversation up to and including its closing ``<|im_end|>``; without
one the prompt is the text itself and each response its text and EOS (as prompt/response SFT
data). Labels cover the responses only. Both responses get the same budget after the prompt,
``seq_length − len(prompt)``, and are cut to it; a pair whose prompt leaves no room is an error
naming its line, or with ``skip_bad`` is left out and counted.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.chat import render
from mindqwen.data.loader import TokenDataset
from mindqwen.io.textfile import read_lines

Messages = List[dict]
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class PreferencePair:
    """A prompt (text or messages) and two responses (text or assistant messages)."""

    prompt: Union[str, Messages]
    chosen: Union[str, Messages]
    rejected: Union[str, Messages]


def parse_record(record: dict) -> PreferencePair:
    """One record in any accepted form.

    Raises:
        ValueError: what the record lacks or holds of the wrong type.
    """
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    if "conversations" in record:  # ShareGPT
        turns = [_sharegpt(t) for t in _list(record["conversations"], "conversations")]
        system = [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
        return PreferencePair(system + turns, [_sharegpt(record.get("chosen"))], [_sharegpt(record.get("rejected"))])
    if "instruction" in record:  # alpaca
        text = "\n".join(x for x in (record["instruction"], record.get("input") or "") if x)
        return PreferencePair(_text(text, "instruction"), _text(record.get("chosen"), "chosen"),
                              _text(record.get("rejected"), "rejected"))
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            if isinstance(record.get("chosen"), list):
                prompt = [{"role": "user", "content": prompt}]
        else:
            prompt = _list(prompt, "prompt")
        return PreferencePair(prompt, _response(record.get("chosen"), "chosen"),
                              _response(record.get("rejected"), "rejected"))
    chosen, rejected = _list(record.get("chosen"), "chosen"), _list(record.get("rejected"), "rejected")
    shared = 0  # the implicit prompt: the messages both conversations start with
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ValueError("no prompt: give \"prompt\", or chosen and rejected conversations that share their start")
    return PreferencePair(chosen[:shared], chosen[shared:], rejected[shared:])


def _text(value, key: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"\"{key}\" must be a string, got {type(value).__name__}")
    return value


def _list(value, key: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"\"{key}\" must be a non-empty list of messages")
    return value


def _response(value, key: str):
    return value if isinstance(value, str) else _list(value, key)


def _sharegpt(turn) -> dict:
    if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
        raise ValueError(f"a ShareGPT turn is {{\"from\": system|human|gpt, \"value\": <string>}}, got {turn!r:.80}")
    return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}


def pair_texts(pair: PreferencePair, template: Optional[str]) -> Tuple[str, str, str]:
    """(prompt, chosen, rejected) texts: the template rendered once (see the module's docstring),
    or the plain text. Raises ValueError for messages without a template."""
    if template is None:
        if not all(isinstance(x, str) for x in (pair.prompt, pair.chosen, pair.rejected)):
            raise ValueError("conversational records need a chat template (preference.template)")
        return pair.prompt, pair.chosen, pair.rejected
    prompt = [{"role": "user", "content": pair.prompt}] if isinstance(pair.prompt, str) else pair.prompt
    head = render(prompt, template, add_generation_prompt=True)[0]
    responses = []
    for response in (pair.chosen, pair.rejected):
        turns = [{"role": "assistant", "content": response}] if isinstance(response, str) else response
        full = render(prompt + turns, template)[0]
        if not full.startswith(head):  # cannot happen with assistant turns after the prompt
            raise ValueError("the response does not continue the prompt in the chat template")
        tail = full[len(head):]
        responses.append(tail[:tail.rindex("<|im_end|>") + len("<|im_end|>")])
    return head, responses[0], responses[1]


def encode_pairs(pairs: Sequence[Tuple[int, PreferencePair]], tokenizer, seq_length: int, template: Optional[str],
                 skip_bad: bool = False, source: str = "pairs") -> Tuple[TokenDataset, int]:
    """(TokenDataset of (N, 2, seq_length) rows, pairs left out) from (line, pair) items.

    Raises:
        ValueError: ``source:line: why`` for a pair that cannot be encoded (unless ``skip_bad``).
    """
    ids = np.full((len(pairs), 2, seq_length), tokenizer.pad_token_id, np.int32)
    labels = np.full((len(pairs), 2, seq_length), IGNORE_INDEX, np.int32)
    kept = dropped = 0
    eos = [] if template else [tokenizer.eos_token_id]
    for line, pair in pairs:
        try:
            prompt, chosen, rejected = pair_texts(pair, template)
            p = tokenizer.encode(prompt)
            budget = seq_length - len(p)  # the same for both responses
            if budget < 1:
                raise ValueError(f"the prompt is {len(p)} tokens, leaving no room in seq_length={seq_length}")
        except ValueError as e:
            if not skip_bad:
                raise ValueError(f"{source}:{line}: {e}") from None
            dropped += 1
            continue
        for j, text in enumerate((chosen, rejected)):
            r = (tokenizer.encode(text) + eos)[:budget]
            ids[kept, j, :len(p) + len(r)] = p + r
            labels[kept, j, len(p):len(p) + len(r)] = r
        kept += 1
    if kept == 0:
        raise ValueError(f"{source}: no pair fits in seq_length={seq_length} ({dropped} left out)")
    return TokenDataset(ids[:kept], labels[:kept]), dropped


def read_pairs(path: str) -> List[Tuple[int, PreferencePair]]:
    """(line, pair) of every record of a JSON-lines file.

    Raises:
        ValueError: ``path:line: what`` for the first malformed record.
    """
    pairs = []
    for n, line, _ in read_lines(path):
        if not line.strip():
            continue
        try:
            pairs.append((n, parse_record(json.loads(line))))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


def load_pairs(path: str, tokenizer, seq_length: int, template: Optional[str] = None,
               skip_bad: bool = False) -> Tuple[TokenDataset, int]:
    """A JSON-lines file of preference records → (rows, pairs left out)."""
    return encode_pairs(read_pairs(path), tokenizer, seq_length, template, skip_bad, path)
