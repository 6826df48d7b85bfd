"""Image-conditioned generation: the image's cross-attention keys/values computed once in prefill
and held beside the KV cache, against full recomputation of the fused model."""
import functools
import os
from dataclasses import replace

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindqwen import generate
from mindqwen.generation import GenerationConfig, Generator, SlotBatch
from mindqwen.models.kv_cache import CacheLayout, ImageCachedStep, ImageKeysValues
from test_multimodal import IMAGE_TOKEN, _fused

PROMPTS = [[20, 31, IMAGE_TOKEN, 40, 41, 42, 43], [55, IMAGE_TOKEN, 60]]  # lengths 7 and 3: left-padded


def _model(frames=1):
    """The fused tiny model with open gates (at zero the images would change nothing)."""
    lm, model = _fused(frames)
    for block in model.cross_attn:
        block.gate.set_data(Tensor(np.array([0.8], np.float32)))
    model.set_train(False)
    return lm, model


@functools.lru_cache(maxsize=None)
def _shared_model(frames):
    """``_model(frames)`` built once for the tests that only run it (and so share its compiled
    generation graphs); a test that changes the model builds its own."""
    return _model(frames)


def _images(n, frames=1, seed=0):
    shape = (n, 3, 16, 16) if frames == 1 else (n, frames, 3, 16, 16)
    return np.random.default_rng(seed).normal(0, 1, shape).astype(np.float32)


def _full_logits(model, ids, image):
    """The fused model's logits at every position of the whole sequence (S, V), no cache."""
    return model(Tensor(np.array([ids], np.int32)), Tensor(image[None])).asnumpy()[0]


def _assert_greedy(model, prompt, image, tokens):
    """Each generated token is the argmax of full recomputation given everything before it
    (one forward over prompt + tokens: position j predicts token j + 1)."""
    logits = _full_logits(model, list(prompt) + list(tokens[:-1]), image)
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == list(tokens)


@pytest.mark.parametrize("frames", [1, 4])
def test_cached_steps_equal_full_recomputation_on_a_left_padded_batch(frames):
    """Prefill (both prompts left-padded to 7) and four decode steps in graph mode, the image
    keys/values computed once: every step's logits equal the full forward of each unpadded row."""
    _, model = _shared_model(frames)
    images = _images(2, frames)
    assert np.abs(_full_logits(model, PROMPTS[1], images[0]) - _full_logits(model, PROMPTS[1], images[1]))[-1].max() > 1e-2
    follow = [[70, 71, 72, 73], [80, 81, 82, 83]]  # the tokens fed back, one per step
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        step, kv = ImageCachedStep(model), ImageKeysValues(model)
        image_k, image_v = kv(Tensor(images))
        s, length = 7, 16
        ids, positions = np.zeros((2, s), np.int32), np.zeros((2, s), np.int32)
        mask, sees = np.zeros((2, length), np.int32), np.zeros((2, s, 1), np.float32)
        for i, p in enumerate(PROMPTS):
            ids[i, s - len(p):], positions[i, s - len(p):], mask[i, s - len(p):s] = p, np.arange(len(p)), 1
            sees[i, s - len(p):, 0] = np.cumsum(np.array(p) == IMAGE_TOKEN) > 0
        layout = CacheLayout.of(model.config, 2, length)
        logits, k, v = step(Tensor(ids), Tensor(positions), Tensor(mask), Tensor(np.tile(np.arange(s, dtype=np.int32), (2, 1))),
                            layout.zeros(), layout.zeros(), image_k, image_v, Tensor(sees))
        got = [logits.asnumpy()]
        for t in range(4):
            mask[:, s + t] = 1
            token = np.array([[follow[0][t]], [follow[1][t]]], np.int32)
            pos = np.array([[len(p) + t] for p in PROMPTS], np.int32)
            logits, k, v = step(Tensor(token), Tensor(pos), Tensor(mask), Tensor(np.full((2, 1), s + t, np.int32)),
                                k, v, image_k, image_v, Tensor(np.ones((2, 1, 1), np.float32)))
            got.append(logits.asnumpy())
    finally:
        ms.set_context(mode=mode)
    for i, p in enumerate(PROMPTS):
        full = _full_logits(model, p + follow[i], images[i])
        for t in range(5):
            want = full[len(p) - 1 + t]
            assert np.abs(got[t][i] - want).max() <= 5e-5, (i, t, np.abs(got[t][i] - want).max())


def test_a_fused_model_is_an_image_conditioned_lm():
    from mindqwen.models.kv_cache import ImageConditionedLM
    lm, model = _shared_model(1)
    assert isinstance(model, ImageConditionedLM) and not isinstance(lm, ImageConditionedLM)
    assert model.cache_dtype == lm.cache_dtype == ms.float32


def test_generator_rows_with_images_without_and_joining_later_equal_full_recomputation():
    """Greedy generation through ``SlotBatch``: a text-only row first (its prefill runs no ViT:
    it generates what the LM alone generates), two rows with their own images joining it, and a
    row that joins the running batch later (its image keys/values move into the cache's row
    layout); each row's tokens equal the greedy chain of full recomputation."""
    lm, model = _shared_model(1)
    images = _images(3, seed=1)
    config = GenerationConfig(max_new_tokens=6)
    gen = Generator(model)
    vit_rows, vit = [], gen.steps.image.keys_values
    counted = replace(gen.steps.image, keys_values=lambda pixels: (vit_rows.append(pixels.shape[0]), vit(pixels))[1])
    batch = SlotBatch(replace(gen.steps, image=counted), 4)
    tokens = {}
    with gen.graph_mode():
        batch.join([[90, 91, 92]], [config], ["text"], images=[None])
        batch.step()
        batch.join(PROMPTS, [config] * 2, ["a", "b"], images=[images[0], images[1]])
        batch.step()
        batch.join([[33, IMAGE_TOKEN, 34, 35]], [config], ["late"], images=[images[2]])
        while batch.active:
            batch.step()
    for row in batch.pop_finished():
        tokens[row.owner] = row.tokens
    for key, prompt, image in [("a", PROMPTS[0], images[0]), ("b", PROMPTS[1], images[1]),
                               ("late", [33, IMAGE_TOKEN, 34, 35], images[2])]:
        _assert_greedy(model, prompt, image, tokens[key])
    assert tokens["text"] == generate(lm, [[90, 91, 92]], max_new_tokens=6)[0, 3:].tolist()
    assert vit_rows == [2, 1]  # the ViT ran for the joins that bring images, not for the text row


def test_top_level_generate_takes_pixel_values_and_bad_images_are_refused():
    _, model = _shared_model(1)
    images = _images(2, seed=2)
    out = generate(model, PROMPTS, max_new_tokens=3, pixel_values=images)
    for i, p in enumerate(PROMPTS):
        _assert_greedy(model, p, images[i], out[i, -3:].tolist())
    gen = Generator(model)
    with pytest.raises(ValueError, match="holds the image token 7 but no image was given"):
        gen.run([PROMPTS[0]], GenerationConfig(max_new_tokens=1))
    with pytest.raises(ValueError, match="comes with an image but holds no image token"):
        gen.run([[20, 21]], GenerationConfig(max_new_tokens=1), images=[images[0]])
    with pytest.raises(ValueError, match=r"pixel values of shape \(3, 8, 8\), the model takes \(3, 16, 16\)"):
        gen.run([PROMPTS[0]], GenerationConfig(max_new_tokens=1), images=[images[0][:, :8, :8]])
    with pytest.raises(ValueError, match="has no vision tower"):
        Generator(model.lm).run([[20, 21]], GenerationConfig(max_new_tokens=1), images=[images[0]])


@pytest.mark.parametrize("frames", [4])  # images: the shapes demo test checks its export's image parity
def test_the_image_export_reproduces_the_eager_model_in_a_process_without_mindqwen(frames, tmp_path):
    """image/ of a fused model with trained LoRA: its runner, in a fresh process that never imports
    mindqwen, generates for a left-padded batch with one image per row; every step's logits
    equal the fused model's full forward (LoRA unmerged, no cache) within 5e-5, and the export's
    own parity report passed. Bad input to the runner is refused with the reason."""
    import subprocess
    import sys
    from mindqwen.export.mindir import run_exported_process
    from mindqwen.export.vision import export_image_graphs
    from mindqwen.multimodal.fusion import apply_multimodal_lora
    _, model = _model(frames)
    apply_multimodal_lora(model)
    rng = np.random.default_rng(3)
    for p in model.trainable_params():  # LoRA B is zero at init: give every adapter a delta
        p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    folder = tmp_path / "image"
    report = export_image_graphs(model, str(folder), [2], 32, [16], "Ascend310", None)
    assert report["passed"] and (folder / "image_kv.mindir").is_file() and (folder / "lite" / "image_kv.cfg").is_file()
    images = _images(2, frames, seed=4)
    tokens, logits = run_exported_process(str(folder), PROMPTS, 4, images)
    for i, p in enumerate(PROMPTS):
        full = _full_logits(model, p + tokens[i, :-1].tolist(), images[i])[len(p) - 1:]
        assert np.abs(full - logits[:, i]).max() <= 5e-5 and full.argmax(-1).tolist() == tokens[i].tolist()
    run = [sys.executable, str(folder / "run_exported.py"), str(folder), "--prompt-ids", "5,6"]
    out = subprocess.run(run + ["--max-new-tokens", "2"], capture_output=True, text=True)
    assert out.returncode != 0 and "needs --pixels or --image" in out.stderr
    np.save(tmp_path / "one.npy", images[:1])
    out = subprocess.run(run + ["--pixels", str(tmp_path / "one.npy")], capture_output=True, text=True)
    assert out.returncode != 0 and "every prompt needs the image token 7" in out.stderr


def test_the_server_answers_image_content_parts_as_the_generator_does(tmp_path):
    """POST /v1/chat/completions with an OpenAI ``image_url`` part (a base64 data URL, or a path
    in the server's allowed folder) answers what the Generator answers for the same prompt and
    pixels; bad image parts get 400 naming why, refused paths one message for every reason."""
    import base64
    import json
    from PIL import Image
    from mindqwen.data.chat import render
    from mindqwen.data.tokenizer import ByteTokenizer  # bytes are ids: byte 7 never occurs in text
    from mindqwen.multimodal.data import apply_transforms, image_transforms, load_image
    from mindqwen.serve import Server
    from test_serve import _post
    _, model = _shared_model(1)
    generator = Generator(model, ByteTokenizer())
    Image.fromarray(np.random.default_rng(5).integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(tmp_path / "x.png")
    data_url = "data:image/png;base64," + base64.b64encode((tmp_path / "x.png").read_bytes()).decode()
    text = render([{"role": "user", "content": "\0What is it?"}], "qwen2.5", add_generation_prompt=True)[0]
    before, after = text.split("\0")
    prompt = list(before.encode()) + [IMAGE_TOKEN] + list(after.encode())
    pixels = apply_transforms(load_image(str(tmp_path / "x.png")), image_transforms(16))
    alone = generator.run([prompt], GenerationConfig(max_new_tokens=5, eos_token_id=0), images=[pixels])[0]
    media = tmp_path / "media"
    media.mkdir()
    Image.open(tmp_path / "x.png").save(media / "x.png")
    (media / "broken.png").write_bytes(b"not an image")
    os.symlink(tmp_path / "x.png", media / "out.png")  # a link out of the folder
    server = Server(generator, port=0, defaults=GenerationConfig(max_new_tokens=5),
                    allowed_local_media_path=str(media)).start()
    try:
        def chat(parts, **extra):
            body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 5, "temperature": 0, **extra}
            return _post(server, "/v1/chat/completions", body)

        question = {"type": "text", "text": "What is it?"}
        for url in (data_url, str(media / "x.png"), f"file://{media / 'x.png'}", str(media / ".." / "media" / "x.png")):
            status, body = chat([{"type": "image_url", "image_url": {"url": url}}, question])
            assert status == 200, body
            assert json.loads(body)["choices"][0]["message"]["content"] == alone.text
        image = {"type": "image_url", "image_url": {"url": data_url}}
        for parts, why in [([image, image, question], "a request carries one image"),
                           ([{"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}], "not fetched over"),
                           ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}], "not valid base64"),
                           ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
                            "image_url: cannot read the image"),
                           ([{"type": "text", "text": "\x07 hi"}], "holds the image token 7 without an image")]:
            status, body = chat(parts)
            assert status == 400 and why in json.loads(body)["error"]["message"], (why, body)
        # Every refused path, whatever the reason, gets one message: outside the folder (a file that
        # exists, by a path, "..", a link), missing, not an image, a folder.
        refused = {chat([{"type": "image_url", "image_url": {"url": url}}, question])
                   for url in (str(tmp_path / "x.png"), str(media / ".." / "x.png"), str(media / "out.png"),
                               str(media / "none.png"), str(media / "broken.png"), str(media), "/etc/passwd")}
        assert len(refused) == 1 and next(iter(refused))[0] == 400, refused
    finally:
        server.shutdown()
    server = Server(generator, port=0).start()  # the default: no local paths at all
    try:
        status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": str(tmp_path / "x.png")}}]}]})
        assert status == 400 and "local image paths are off" in body
    finally:
        server.shutdown()
    with pytest.raises(ValueError, match="is not a folder"):
        Server(generator, port=0, allowed_local_media_path=str(tmp_path / "x.png"))


def test_the_server_decodes_images_off_the_event_loop(tmp_path):
    """While one request's image is being read, the server still answers others: the image is
    decoded on an executor thread, not on the event loop."""
    import http.client
    import threading
    from PIL import Image
    from mindqwen.data.tokenizer import ByteTokenizer
    from mindqwen.serve import Server
    from test_serve import _post
    _, model = _shared_model(1)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "x.png")
    server = Server(Generator(model, ByteTokenizer()), port=0, defaults=GenerationConfig(max_new_tokens=2),
                    allowed_local_media_path=str(tmp_path)).start()
    reading, release, read = threading.Event(), threading.Event(), server.read_image
    server.read_image = lambda url: (reading.set(), release.wait(60), read(url))[-1]
    try:
        answer = []
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": str(tmp_path / "x.png")}}]}], "max_tokens": 2}
        chat = threading.Thread(target=lambda: answer.append(_post(server, "/v1/chat/completions", body)))
        chat.start()
        assert reading.wait(60)
        conn = http.client.HTTPConnection(*server.address, timeout=10)  # a loop held by the image times out
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        release.set()
        chat.join(120)
        assert answer and answer[0][0] == 200, answer
    finally:
        release.set()
        server.shutdown()
