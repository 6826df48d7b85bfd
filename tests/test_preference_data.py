"""Preference pairs from JSON lines: every accepted form gives the same rows, the chat template is
applied once (the rows equal the SFT encoding of the same conversation), both responses get the
same budget, and bad records name their line."""
import json

import numpy as np
import pytest

from mindqwen.config import IGNORE_INDEX
from mindqwen.data.chat import encode_chat
from mindqwen.data.preference import load_pairs
from mindqwen.data.tokenizer import QwenTokenizer
from test_tokenizer import hf_folder  # noqa: F401  (fixture: a byte-level BPE with Qwen's added tokens)

Q, GOOD, BAD = "Upper-case k q z.", "K Q Z", "K q Z"
FORMS = {
    "standard": {"prompt": Q, "chosen": GOOD, "rejected": BAD},
    "conversational": {"prompt": [{"role": "user", "content": Q}], "chosen": [{"role": "assistant", "content": GOOD}],
                       "rejected": [{"role": "assistant", "content": BAD}]},
    "implicit prompt": {"chosen": [{"role": "user", "content": Q}, {"role": "assistant", "content": GOOD}],
                        "rejected": [{"role": "user", "content": Q}, {"role": "assistant", "content": BAD}]},
    "alpaca": {"instruction": "Upper-case", "input": "k q z.", "chosen": GOOD, "rejected": BAD},
    "sharegpt": {"conversations": [{"from": "human", "value": Q}], "chosen": {"from": "gpt", "value": GOOD},
                 "rejected": {"from": "gpt", "value": BAD}},
}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture
def tok(hf_folder):  # noqa: F811
    return QwenTokenizer.from_pretrained(str(hf_folder[0]))


@pytest.mark.parametrize("template", ["qwen2.5", "qwen3"])
def test_every_form_gives_the_rows_of_the_sft_encoding(tmp_path, tok, template):
    rows = {}
    for name, record in FORMS.items():
        data, dropped = load_pairs(_write(tmp_path / f"{name}.jsonl", [record]), tok, 96, template)
        assert dropped == 0
        rows[name] = data
    alpaca = rows.pop("alpaca")  # its prompt is "instruction\ninput": the same row of another text
    for name, data in rows.items():
        np.testing.assert_array_equal(data.input_ids, rows["standard"].input_ids, err_msg=name)
        np.testing.assert_array_equal(data.labels, rows["standard"].labels, err_msg=name)
    for j, answer in enumerate((GOOD, BAD)):  # the template once: the SFT rows of the same conversation
        messages = [{"role": "user", "content": Q}, {"role": "assistant", "content": answer}]
        ids, labels = encode_chat(messages, tok, template)
        end = int(np.nonzero(labels != IGNORE_INDEX)[0].max()) + 1  # through <|im_end|>
        np.testing.assert_array_equal(rows["standard"].input_ids[0, j, :end], ids[:end])
        np.testing.assert_array_equal(rows["standard"].labels[0, j, :end], labels[:end])
        assert (rows["standard"].labels[0, j, end:] == IGNORE_INDEX).all()
    assert alpaca.input_ids.shape == (1, 2, 96)


def test_plain_pairs_end_with_eos_and_label_the_responses_only(tmp_path, tok):
    data, _ = load_pairs(_write(tmp_path / "p.jsonl", [FORMS["standard"]]), tok, 64)
    p = tok.encode(Q)
    for j, answer in enumerate((GOOD, BAD)):
        r = tok.encode(answer) + [tok.eos_token_id]
        np.testing.assert_array_equal(data.input_ids[0, j, :len(p) + len(r)], p + r)
        assert data.labels[0, j, :len(p)].tolist() == [IGNORE_INDEX] * len(p)
        assert data.labels[0, j, len(p):len(p) + len(r)].tolist() == r


def test_both_responses_get_the_same_budget_and_a_full_prompt_is_refused_or_counted(tmp_path, tok):
    long_answer = " ".join(["word"] * 40)
    p = tok.encode(Q)
    seq = len(p) + 5
    data, _ = load_pairs(_write(tmp_path / "t.jsonl", [{"prompt": Q, "chosen": long_answer, "rejected": BAD + " " + long_answer}]),
                         tok, seq)
    budgets = [(data.labels[0, j] != IGNORE_INDEX).sum() for j in range(2)]
    assert budgets == [5, 5]
    records = [{"prompt": "x " * 200, "chosen": GOOD, "rejected": BAD}, FORMS["standard"]]
    path = _write(tmp_path / "full.jsonl", records)
    with pytest.raises(ValueError, match=r"full\.jsonl:1: the prompt is \d+ tokens"):
        load_pairs(path, tok, 40)
    data, dropped = load_pairs(path, tok, 40, skip_bad=True)
    assert dropped == 1 and len(data) == 1


@pytest.mark.parametrize("line,match", [
    ("{\"prompt\": \"q\", \"chosen\": 3, \"rejected\": \"b\"}", r":2: \"chosen\" must be a non-empty list"),
    ("{\"chosen\": [{\"role\": \"user\", \"content\": \"a\"}], \"rejected\": [{\"role\": \"user\", \"content\": \"b\"}]}",
     r":2: no prompt"),
    ("not json", r":2: not valid JSON"),
    ("{\"conversations\": [{\"from\": \"robot\", \"value\": \"x\"}], \"chosen\": {}, \"rejected\": {}}", r":2: a ShareGPT turn"),
])
def test_bad_records_name_their_line(tmp_path, tok, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(FORMS["standard"]) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        load_pairs(str(path), tok, 64)


def test_conversations_need_a_template(tmp_path, tok):
    with pytest.raises(ValueError, match=r"c\.jsonl:1: conversational records need a chat template"):
        load_pairs(_write(tmp_path / "c.jsonl", [FORMS["conversational"]]), tok, 64)


def test_preprocess_writes_the_rows_that_load_pairs_gives(tmp_path, tok, hf_folder):  # noqa: F811
    from mindqwen.data.preprocess import load_packed, preprocess
    path = _write(tmp_path / "p.jsonl", [FORMS["standard"], FORMS["sharegpt"], FORMS["alpaca"]])
    summary = preprocess([path], str(tmp_path / "out"), str(hf_folder[0]), 48, "preference", template="qwen3",
                         progress=False)
    packed, manifest = load_packed(str(tmp_path / "out"))
    direct, _ = load_pairs(path, tok, 48, "qwen3")
    assert manifest["kind"] == "preference" and summary.rows == 3 and packed.pairs
    np.testing.assert_array_equal(packed.input_ids, direct.input_ids)
    np.testing.assert_array_equal(packed.labels, direct.labels)
