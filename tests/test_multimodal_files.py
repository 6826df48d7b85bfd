"""Image-text and video-text data on disk: JSONL records read through MindSpore's pipeline, exact
resume, errors by file and line, and recipes that train from files through ``mindqwen train``."""
import json

import numpy as np
import pytest
from PIL import Image

from mindqwen.data.chat import encode_chat, render
from mindqwen.data.loader import BatchLoader
from mindqwen.data.tokenizer import train_sentencepiece
from mindqwen.multimodal.data import (MediaColumn, apply_transforms, encode_messages, image_token_id,
                                      image_transforms, read_media_jsonl, sample_frames)
from mindqwen.multimodal.vision import VisionConfig

CAPTIONS = ["a red square", "a blue circle at the top", "a green triangle", "a yellow square at the left",
            "two red circles", "a blue square at the bottom", "a green circle", "one yellow triangle"]
IMAGE = VisionConfig(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=64)
VIDEO = VisionConfig(**{**IMAGE.__dict__, "num_frames": 3})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    prompt = render([{"role": "user", "content": "Describe the image."}], "qwen3", add_generation_prompt=True)[0]
    chat = render([{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": CAPTIONS[3]}], "qwen3")[0]
    return train_sentencepiece(CAPTIONS * 20 + [prompt, chat] * 20, str(tmp_path_factory.mktemp("tok") / "t.model"), 120)


def _write_images(folder, n=8):
    """``n`` PNG/JPEG images of assorted sizes and modes and their JSONL (captions and one conversation)."""
    rng = np.random.default_rng(0)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        h, w = [(20, 30), (16, 16), (40, 25), (33, 17)][i % 4]
        mode, ext = [("RGB", "png"), ("RGBA", "png"), ("L", "png"), ("RGB", "jpg")][i % 4]
        pixels = rng.integers(0, 255, (h, w) if mode == "L" else (h, w, len(mode)), dtype=np.uint8)
        Image.fromarray(pixels, mode).save(folder / "img" / f"{i}.{ext}")
        record = {"image": f"img/{i}.{ext}", "caption": CAPTIONS[i % len(CAPTIONS)]}
        if i == 3:
            record = {"image": f"img/{i}.{ext}", "messages": [
                {"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": CAPTIONS[3]}]}
        lines.append(json.dumps(record))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "train.jsonl"


def test_pipeline_batches_are_the_files_transformed(tokenizer, tmp_path):
    """Every batch the MindSpore pipeline yields (2 read workers, 2 transform workers) holds the
    token rows of its records and the transforms of their files (resize, crop, normalize), read independently with PIL."""
    path = _write_images(tmp_path)
    data, records = read_media_jsonl(str(path), tokenizer, image_token_id(tokenizer), 64, IMAGE, "qwen3", progress=False)
    assert isinstance(data.pixel_values, MediaColumn) and data.pixel_values.shape == (8, 3, 16, 16)
    loader = BatchLoader(data, 3, seed=5)
    for step, batch in enumerate(loader.stream(0, 5)):  # 2 steps per epoch: crosses two epochs
        ids, labels, pixels = batch
        rows = loader.order(step // 2)[(step % 2) * 3:(step % 2) * 3 + 3]
        np.testing.assert_array_equal(ids, data.input_ids[rows])
        np.testing.assert_array_equal(labels, data.labels[rows])
        expected = [apply_transforms(np.asarray(Image.open(tmp_path / records[r]["image"]).convert("RGB")),
                                     image_transforms(16)) for r in rows]
        np.testing.assert_array_equal(pixels, np.stack(expected))
    assert step == 4


def test_resume_mid_epoch_reads_nothing_before_and_yields_the_same_batches(tokenizer, tmp_path, monkeypatch):
    path = _write_images(tmp_path)
    data, _ = read_media_jsonl(str(path), tokenizer, image_token_id(tokenizer), 64, IMAGE, "qwen3", workers=1, progress=False)
    straight = [b for b in BatchLoader(data, 2, seed=1).stream(0, 9)]  # 4 steps per epoch
    loads = []
    load = MediaColumn.load
    monkeypatch.setattr(MediaColumn, "load", lambda self, i: loads.append(i) or load(self, i))
    data.pixel_values.workers = 2
    resumed = list(BatchLoader(data, 2, seed=1).stream(5, 9))  # mid-epoch 2
    assert len(resumed) == 4 and len(loads) == 4 * 2  # only the rows of steps 5..8 were read
    data.pixel_values.read_workers = 2  # reader processes
    in_processes = list(BatchLoader(data, 2, seed=1).stream(5, 9))
    for a, b, c in zip(straight[5:], resumed, in_processes):
        for x, y, z in zip(a, b, c):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(x, z)


def test_a_conversation_puts_the_image_token_in_place_and_trains_on_the_answer_only(tokenizer):
    image_id = image_token_id(tokenizer)
    assert image_id == tokenizer.vocab_size  # one past a SentencePiece vocabulary
    messages = [{"role": "user", "content": "<image>What is it?"}, {"role": "assistant", "content": "a red square"}]
    ids, labels = encode_messages(messages, tokenizer, image_id, 64, "qwen3")
    before = render(messages, "qwen3")[0].split("<image>")[0]
    assert ids.tolist().count(image_id) == 1 and ids[len(tokenizer.encode(before))] == image_id
    plain = [{"role": "user", "content": "What is it?"}, messages[1]]
    ref_ids, ref_labels = encode_chat(plain, tokenizer, "qwen3")  # the text path's assistant-only mask
    assert ids[labels != -100].tolist() == ref_ids[ref_labels != -100].tolist()
    assert tokenizer.decode(ids[labels != -100]).endswith("a red square<|im_end|>")  # Qwen3's turn (think block first)
    assert ids[:len(tokenizer.encode(before)) + 1][labels[:len(tokenizer.encode(before)) + 1] != -100].size == 0
    with pytest.raises(ValueError, match="exactly one <image> or <video> placeholder, found 0"):
        encode_messages(plain, tokenizer, image_id, 64, "qwen3")
    with pytest.raises(ValueError, match="do not fit seq_length 8"):
        encode_messages(messages, tokenizer, image_id, 8, "qwen3")


def test_bad_records_are_reported_by_file_and_line_and_skip_bad_leaves_them_out(tokenizer, tmp_path):
    path = _write_images(tmp_path, 4)
    good = path.read_text().splitlines()
    png = (tmp_path / "img" / "0.png").read_bytes()
    (tmp_path / "img" / "cut.png").write_bytes(png[:len(png) // 2])  # truncated
    bad = {"cut.png": json.dumps({"image": "img/cut.png", "caption": "a red square"}),
           "missing": json.dumps({"image": "img/nope.png", "caption": "a red square"}),
           "json": '{"image": "img/0.png", "caption": ',
           "caption": json.dumps({"image": "img/0.png"}),
           "video": json.dumps({"video": "clip.npy", "caption": "a red square"})}
    why = {"cut.png": r"img/cut.png: cannot read the image", "missing": r"img/nope.png: no such file",
           "json": "not valid JSON", "caption": r'either "caption" \(string\) or "messages"',
           "video": r"expected a 'image' path \(string\) \(this model reads images"}
    for name, line in bad.items():
        path.write_text("\n".join(good[:2] + [line] + good[2:]) + "\n")
        with pytest.raises(ValueError, match=rf"train.jsonl:3: .*{why[name]}"):
            read_media_jsonl(str(path), tokenizer, image_token_id(tokenizer), 64, IMAGE, "qwen3", progress=False)
    path.write_text("\n".join(good[:2] + list(bad.values()) + good[2:]) + "\n")
    with pytest.warns(UserWarning, match=r"skipped 5 bad record\(s\) \(data.skip_bad\), first: .*train.jsonl:3"):
        data, records = read_media_jsonl(str(path), tokenizer, image_token_id(tokenizer), 64, IMAGE, "qwen3",
                                         skip_bad=True, progress=False)
    assert len(data) == 4 and [r["image"] for r in records][2:] == ["img/2.png", "img/3.jpg"]
    assert data.pixel_values.origins[2].endswith("train.jsonl:8")  # lines keep their numbers


def test_video_records_read_npy_arrays_and_frame_folders(tokenizer, tmp_path):
    """A 37-frame .npy clip (memory-mapped, only the sampled frames read) and a folder of frames:
    (T, 3, S, S) per row, each frame the image transforms of the segment-centre frame."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "clip.npy", rng.integers(0, 255, (37, 23, 19, 3), dtype=np.uint8))
    (tmp_path / "frames").mkdir()
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(tmp_path / "frames" / f"{i:03d}.png")
    (tmp_path / "v.jsonl").write_text(json.dumps({"video": "clip.npy", "caption": "a red square"}) + "\n"
                                      + json.dumps({"video": "frames", "caption": "a blue circle"}) + "\n")
    data, _ = read_media_jsonl(str(tmp_path / "v.jsonl"), tokenizer, image_token_id(tokenizer), 64, VIDEO, "qwen3",
                               progress=False)
    batch = next(iter(BatchLoader(data, 2, shuffle=False).stream(0, 1)))
    assert batch[2].shape == (2, 3, 3, 16, 16)
    clip = np.load(tmp_path / "clip.npy")[sample_frames(37, 3)]
    folder = [np.asarray(Image.open(tmp_path / "frames" / f"{i:03d}.png")) for i in sample_frames(5, 3)]
    for row, frames in enumerate([clip, folder]):
        expected = np.stack([apply_transforms(f, image_transforms(16)) for f in frames])
        np.testing.assert_array_equal(batch[2][row], expected)
    np.save(tmp_path / "flat.npy", np.zeros((4, 8, 8), np.uint8))
    (tmp_path / "v.jsonl").write_text(json.dumps({"video": "flat.npy", "caption": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"v.jsonl:1: .*flat.npy: a video array is \(T, H, W, 3\)"):
        read_media_jsonl(str(tmp_path / "v.jsonl"), tokenizer, 99, 64, VIDEO, "qwen3", progress=False)


@pytest.mark.parametrize("frames", [1, 3])
def test_a_recipe_trains_from_jsonl_files_through_mindqwen_train(frames, tokenizer, tmp_path, capsys):
    """``mindqwen train`` on the shapes recipe pointed at files: images (PNG/JPEG, a conversation
    among captions) or .npy videos; validate reads and checks them first, training runs, and
    ``mindqwen generate`` continues the trained run's prompt about an image (or video)."""
    from mindqwen.cli import main
    if frames == 1:
        path = _write_images(tmp_path)
    else:
        rng = np.random.default_rng(1)
        lines = []
        for i in range(8):
            np.save(tmp_path / f"{i}.npy", rng.integers(0, 255, (4 + i, 18, 18, 3), dtype=np.uint8))
            lines.append(json.dumps({"video": f"{i}.npy", "caption": CAPTIONS[i]}))
        path = tmp_path / "train.jsonl"
        path.write_text("\n".join(lines) + "\n")
    settings = [f"data.train={path}", f"data.eval={path}", f"data.tokenizer={tokenizer.path}", "data.seq_length=64",
                "multimodal.shapes=null", "multimodal.text_steps=0", "multimodal.vision_steps=0",
                "multimodal.template=qwen3", f"multimodal.vision.num_frames={frames}", "multimodal.vision.image_size=16",
                "multimodal.vision.num_hidden_layers=1", "model.config.num_hidden_layers=1", "multimodal.cross_layers=[0]",
                "trainer.max_steps=2", "trainer.micro_batch_size=4", "trainer.warmup_steps=1",
                "trainer.progress=false", "export.enabled=false", f"trainer.output_dir={tmp_path / 'out'}"]
    if frames == 1:  # a record whose image is gone: named by validate, left out with --skip-bad
        with open(path, "a") as f:
            f.write(json.dumps({"image": "img/gone.png", "caption": "a red square"}) + "\n")
        assert main(["validate", "multimodal/shapes", *settings]) != 0
        assert "train.jsonl:9: " in capsys.readouterr().err
        assert main(["validate", "multimodal/shapes", *settings, "data.skip_bad=true"]) == 0
    assert main(["train", "multimodal/shapes", *settings, "--skip-bad"]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    metrics = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)
    assert 0 <= summary["caption_exact_match_after"] <= 1
    media = str(tmp_path / ("img/1.png" if frames == 1 else "1.npy"))
    capsys.readouterr()
    assert main(["generate", "multimodal/shapes", *settings, "--image", media, "--max-new-tokens", "3"]) == 0
    assert f"<image {media}> Describe the image." in capsys.readouterr().out
