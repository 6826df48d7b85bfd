"""Chat templates (Qwen2.5 ChatML, Qwen3 with thinking) and assistant-only label masks.

The renderers follow the published Jinja templates of the Qwen2.5 and Qwen3 tokenizer configs
(text messages: system / user / assistant; tools are not rendered). Each returns the prompt text
and the character spans the model should learn to produce: an assistant turn's content (with
Qwen3's think block when the template keeps it) and its closing ``<|im_end|>``. ``encode_chat``
tokenizes the whole text once and labels the tokens that start inside those spans.
``render_jinja`` renders a model folder's own Jinja template (``folder_chat_template``) instead.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindqwen.config import IGNORE_INDEX
from mindqwen.io.jsonfile import read_json

Message = Dict[str, str]  # {"role": system|user|assistant, "content": ..., optional "reasoning_content"}
Span = Tuple[int, int]
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
TEMPLATES = ("qwen2.5", "qwen3")
TRAIN_ON = ("assistant", "last", "all")  # every assistant turn, only the last one, every token


class _Text:
    """Accumulates rendered text and the spans marked as trainable."""

    def __init__(self):
        self.parts: List[str] = []
        self.size = 0
        self.spans: List[Span] = []

    def add(self, text: str, train: bool = False) -> None:
        if train and text:
            self.spans.append((self.size, self.size + len(text)))
        self.parts.append(text)
        self.size += len(text)

    def result(self) -> Tuple[str, List[Span]]:
        return "".join(self.parts), self.spans


def _check(messages: Sequence[Message]) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{role, content}} objects, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") or not isinstance(
                m.get("content"), str):
            raise ValueError(f"message {i}: expected role system|user|assistant and string content, got {m!r:.80}")
        if "reasoning_content" in m and not isinstance(m["reasoning_content"], (str, type(None))):
            raise ValueError(f"message {i}: reasoning_content must be a string")


def render_qwen25(messages: Sequence[Message], add_generation_prompt: bool = False) -> Tuple[str, List[Span]]:
    """Qwen2.5's ChatML: a default system prompt when none is given."""
    _check(messages)
    out = _Text()
    if not messages or messages[0]["role"] != "system":
        out.add(f"<|im_start|>system\n{QWEN25_DEFAULT_SYSTEM}<|im_end|>\n")
    for m in messages:
        out.add(f"<|im_start|>{m['role']}\n")
        out.add(m["content"] + "<|im_end|>", train=m["role"] == "assistant")
        out.add("\n")
    if add_generation_prompt:
        out.add("<|im_start|>assistant\n")
    return out.result()


def _split_think(m: Message) -> Tuple[str, str]:
    """(reasoning, answer) of an assistant message, as the Qwen3 template splits them."""
    content = m["content"]
    if isinstance(m.get("reasoning_content"), str):
        return m["reasoning_content"], content
    if "</think>" in content:
        parts = content.split("</think>")
        return parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), parts[-1].lstrip("\n")
    return "", content


def render_qwen3(messages: Sequence[Message], add_generation_prompt: bool = False,
                 enable_thinking: bool = True) -> Tuple[str, List[Span]]:
    """Qwen3: no default system prompt; assistant turns after the last user message keep their
    think block (the last one always, rendering an empty block if there is no reasoning);
    earlier turns drop it. ``enable_thinking=False`` pre-fills an empty think block."""
    _check(messages)
    out = _Text()
    last_query = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=len(messages) - 1)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            out.add(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
            continue
        reasoning, answer = _split_think(m)
        out.add("<|im_start|>assistant\n")
        last = i == len(messages) - 1
        if i > last_query and (last or reasoning):
            body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{answer.lstrip(chr(10))}"
        else:
            body = answer
        out.add(body + "<|im_end|>", train=True)
        out.add("\n")
    if add_generation_prompt:
        out.add("<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n"))
    return out.result()


def render(messages: Sequence[Message], template: str = "qwen2.5", **kwargs) -> Tuple[str, List[Span]]:
    if template not in TEMPLATES:
        raise ValueError(f"chat template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    return (render_qwen25 if template == "qwen2.5" else render_qwen3)(messages, **kwargs)


def encode_chat(messages: Sequence[Message], tokenizer, template: str = "qwen2.5",
                train_on: str = "assistant") -> Tuple[np.ndarray, np.ndarray]:
    """(ids, labels) int32 of one conversation; labels are -100 outside the trained spans.

    Args:
        train_on: assistant (every assistant turn), last (the last assistant turn only: earlier
            history is context), all (every token).
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    text, spans = render(messages, template)
    ids, starts = tokenizer.encode_with_offsets(text)  # starts: character offset of each token
    if train_on == "all":
        return np.asarray(ids, np.int32), np.asarray(ids, np.int32)
    if train_on == "last":
        spans = spans[-1:]
    inside = np.zeros(len(ids), bool)
    for lo, hi in spans:
        inside |= (np.asarray(starts) >= lo) & (np.asarray(starts) < hi)
    ids_arr = np.asarray(ids, np.int32)
    return ids_arr, np.where(inside, ids_arr, IGNORE_INDEX).astype(np.int32)


# ---------------------------------------------------------------------- a model folder's own template
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued final message ends


def folder_chat_template(folder: str) -> Optional[str]:
    """The Jinja chat template a tokenizer folder ships (``chat_template.jinja``, or
    ``tokenizer_config.json``'s ``chat_template``: a string, or named templates of which
    ``default`` is taken); None when it has none."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(folder, "tokenizer_config.json")
    template = read_json(path, ValueError, "tokenizer config").get("chat_template") if os.path.isfile(path) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def render_jinja(template: str, messages: Sequence[Message], add_generation_prompt: bool = False,
                 continue_final_message: bool = False, **variables) -> str:
    """A Jinja chat template rendered the way model folders expect: a sandbox with trimmed
    blocks, ``loopcontrols``, ``raise_exception``, a ``tojson`` that keeps non-ASCII text and
    ``strftime_now``. ``continue_final_message``: the text stops where the last message's
    content ends, so a model continues it (a prefilled answer). ``variables``: the special
    tokens the template reads (``eos_token``, ...)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    messages = [dict(m) for m in messages]
    final = messages[-1]["content"] if continue_final_message and messages else None
    if final is not None:
        messages[-1]["content"] = final + _CONTINUE_TAG
    text = env.from_string(template).render(messages=messages, tools=None, documents=None,
                                            add_generation_prompt=add_generation_prompt, **variables)
    if final is None:
        return text
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("the chat template drops part of the final message, so it cannot be continued")
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
