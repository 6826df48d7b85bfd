"""Chat templates string-equal to Qwen's published Jinja (expected strings written out from it),
and label masks covering exactly the assistant spans."""
import numpy as np
import pytest

from mindqwen.data.chat import encode_chat, render
from mindqwen.data.tokenizer import QwenTokenizer
from test_tokenizer import hf_folder  # noqa: F401  (fixture: a byte-level BPE with Qwen's added tokens)

SYS25 = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
HI = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
MULTI = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n2"},
         {"role": "user", "content": "times 3?"}, {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n6"}]


@pytest.mark.parametrize("template,messages,kwargs,expected", [
    ("qwen2.5", HI, {}, SYS25 + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"),
    ("qwen2.5", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
     {"add_generation_prompt": True},
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    # Qwen3: no default system; the last assistant turn always shows a think block (empty here)
    ("qwen3", HI, {}, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n"),
    # history before the last user message loses its reasoning; the final turn keeps it
    ("qwen3", MULTI, {}, "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2<|im_end|>\n"
                         "<|im_start|>user\ntimes 3?<|im_end|>\n<|im_start|>assistant\n<think>\nmultiply\n</think>\n\n6<|im_end|>\n"),
    ("qwen3", [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
     {"add_generation_prompt": True, "enable_thinking": False},
     "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    ("qwen3", [{"role": "user", "content": "Hi"}], {"add_generation_prompt": True},
     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("qwen3", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "\nwhy\n"}], {},
     "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nwhy\n</think>\n\nA<|im_end|>\n"),
])
def test_render_equals_published_template(template, messages, kwargs, expected):
    assert render(messages, template, **kwargs)[0] == expected


@pytest.mark.parametrize("template,train_on,trained", [
    ("qwen2.5", "assistant", ["2<|im_end|>", "<think>\nmultiply\n</think>\n\n6<|im_end|>"]),
    ("qwen3", "assistant", ["2<|im_end|>", "<think>\nmultiply\n</think>\n\n6<|im_end|>"]),
    ("qwen3", "last", ["<think>\nmultiply\n</think>\n\n6<|im_end|>"]),
])
def test_labels_cover_exactly_the_assistant_spans(hf_folder, template, train_on, trained):  # noqa: F811
    tok = QwenTokenizer.from_pretrained(str(hf_folder[0]))
    messages = MULTI if template == "qwen3" else [dict(m, content=m["content"].split("\n")[-1] if m["role"] == "assistant"
                                                       and "</think>" in m["content"] else m["content"]) for m in MULTI]
    if template == "qwen2.5":
        trained = [t.split("\n")[-1] for t in trained]  # Qwen2.5 has no think blocks: "2<|im_end|>", "6<|im_end|>"
    ids, labels = encode_chat(messages, tok, template, train_on)
    assert ids.tolist() == tok.encode(render(messages, template)[0])
    kept = labels != -100
    assert (labels[kept] == ids[kept]).all()
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(kept.astype(int))) + 1)  # contiguous runs
    assert [tok.decode(ids[r]) for r in runs if kept[r[0]]] == trained
    _, all_labels = encode_chat(messages, tok, template, "all")
    assert (all_labels == ids).all()


def test_bad_messages_are_named():
    with pytest.raises(ValueError, match="message 1: expected role"):
        render([{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}])
