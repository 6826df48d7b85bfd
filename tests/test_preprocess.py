"""Preprocessing: packing keeps every token exactly once, EOS between documents, labels masked
where they should be; output identical for 1 and 4 workers; bad input named by file and line."""
import json
import os

import numpy as np
import pytest

from mindqwen.data.chat import encode_chat
from mindqwen.data.preprocess import load_packed, preprocess
from mindqwen.data.tokenizer import QwenTokenizer
from test_tokenizer import CORPUS, hf_folder  # noqa: F401  (fixture: a Qwen-style byte-level BPE)


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n")
    return str(path)


@pytest.fixture
def text_file(tmp_path):
    docs = [CORPUS[i % len(CORPUS)] * (1 + i % 3) for i in range(600)]  # > 2 worker chunks of 256
    return write_jsonl(tmp_path / "text.jsonl", [{"text": d} for d in docs]), docs


def test_text_packing_keeps_every_token_once_with_eos(hf_folder, text_file, tmp_path):  # noqa: F811
    path, docs = text_file
    tok = QwenTokenizer.from_pretrained(str(hf_folder[0]))
    s = preprocess([path], str(tmp_path / "out"), str(hf_folder[0]), 64, "text", progress=False)
    data, manifest = load_packed(str(tmp_path / "out"))
    expected = [t for d in docs for t in tok.encode(d) + [tok.eos_token_id]]
    flat = np.asarray(data.input_ids).reshape(-1)
    assert flat[:len(expected)].tolist() == expected  # every token once, in order, EOS after each document
    assert (flat[len(expected):] == tok.pad_token_id).all() and len(flat) - len(expected) < 64
    labels = np.asarray(data.labels).reshape(-1)
    assert (labels[:len(expected)] == expected).all() and (labels[len(expected):] == -100).all()
    assert s.tokens == len(expected) and manifest["documents"] == 600 and manifest["seq_length"] == 64


def test_one_and_four_workers_write_identical_files(hf_folder, text_file, tmp_path):  # noqa: F811
    path, _ = text_file
    for workers in (1, 4):
        preprocess([path], str(tmp_path / f"w{workers}"), str(hf_folder[0]), 64, "text", workers=workers, progress=False)
    for name in ("input_ids.npy", "labels.npy", "position_ids.npy", "manifest.json"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w4" / name).read_bytes(), name


def test_sft_rows_hold_whole_conversations_with_assistant_labels(hf_folder, tmp_path):  # noqa: F811
    tok = QwenTokenizer.from_pretrained(str(hf_folder[0]))
    chats = [[{"role": "user", "content": f"question {i} 你好"}, {"role": "assistant", "content": f"answer {i} 😀"}]
             for i in range(20)]
    records = [{"messages": c} for c in chats[:10]] + [
        {"instruction": c[0]["content"], "input": "", "output": c[1]["content"]} for c in chats[10:]]
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    s = preprocess([path], str(tmp_path / "out"), str(hf_folder[0]), 96, "sft", progress=False)
    data, _ = load_packed(str(tmp_path / "out"))
    expected = [encode_chat(c, tok) for c in chats]  # Alpaca records render as the same one-turn chat
    ids, labels = np.asarray(data.input_ids), np.asarray(data.labels)
    found = 0
    for e_ids, e_labels in expected:  # each conversation sits whole in one row, labels unchanged
        for r in range(len(ids)):
            hits = [a for a in range(96 - len(e_ids) + 1) if (ids[r, a:a + len(e_ids)] == e_ids).all()]
            if hits:
                assert (labels[r, hits[0]:hits[0] + len(e_ids)] == e_labels).all()
                found += 1
                break
    assert found == 20 and s.truncated == 0
    assert int((labels != -100).sum()) == sum(int((lab != -100).sum()) for _, lab in expected)


def test_bad_lines_are_named_or_skipped_and_nothing_is_left(hf_folder, tmp_path):  # noqa: F811
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{not json\n{"txt": "wrong key"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        preprocess([str(path)], str(tmp_path / "out"), str(hf_folder[0]), 16, "text", progress=False)
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".preprocess")]
    s = preprocess([str(path)], str(tmp_path / "out"), str(hf_folder[0]), 16, "text", skip_bad=True, progress=False)
    assert s.skipped == 2 and s.skipped_lines == [f"{path}:3", f"{path}:4"] and s.documents == 2
    with pytest.raises(FileExistsError):
        preprocess([str(path)], str(tmp_path / "out"), str(hf_folder[0]), 16, "text", skip_bad=True, progress=False)


def test_mindspore_dataset_resumes_at_step_k_exactly(hf_folder, text_file, tmp_path):  # noqa: F811
    from mindqwen.data.loader import BatchLoader, mindspore_dataset
    path, _ = text_file
    preprocess([path], str(tmp_path / "out"), str(hf_folder[0]), 32, "text", progress=False)
    data, _ = load_packed(str(tmp_path / "out"))
    loader = BatchLoader(data, 8, seed=3, rank=1, world=2)
    steps = 3 * loader.steps_per_epoch + 2  # crosses epoch boundaries (reshuffles)

    def run(start, workers):
        ds = mindspore_dataset(loader, steps, start, workers)
        return [(b["input_ids"], b["labels"]) for b in ds.create_dict_iterator(num_epochs=1, output_numpy=True)]

    full = run(0, 1)
    assert len(full) == steps and all(b[0].shape == (8, 32) and b[0].dtype == np.int32 for b in full)
    k = loader.steps_per_epoch + 3
    resumed = run(k, 2)
    assert len(resumed) == steps - k
    for (a_ids, a_lab), (b_ids, b_lab) in zip(full[k:], resumed):
        assert (a_ids == b_ids).all() and (a_lab == b_lab).all()


def test_json_array_input_equals_jsonl(hf_folder, tmp_path):  # noqa: F811
    records = [{"text": t} for t in CORPUS]
    (tmp_path / "a.json").write_text(json.dumps(records, ensure_ascii=False))
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    preprocess([str(tmp_path / "a.json")], str(tmp_path / "j"), str(hf_folder[0]), 32, "text", progress=False)
    preprocess([jsonl], str(tmp_path / "l"), str(hf_folder[0]), 32, "text", progress=False)
    assert (tmp_path / "j" / "input_ids.npy").read_bytes() == (tmp_path / "l" / "input_ids.npy").read_bytes()
    (tmp_path / "bad.json").write_text(json.dumps([{"text": "ok"}, {"txt": "no"}]))
    with pytest.raises(ValueError, match=r"bad\.json\[1\]: missing \"text\""):
        preprocess([str(tmp_path / "bad.json")], str(tmp_path / "b"), str(hf_folder[0]), 32, "text", progress=False)
