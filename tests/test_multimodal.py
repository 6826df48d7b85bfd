"""Multimodal fusion: zero gate = the text model, LM keys unchanged, gradients per group policy,
trainable counts in closed form (image and video), the image pipeline."""

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import fixture_path
from mindqwen import from_pretrained
from mindqwen.lora import lora_layers
from mindqwen.multimodal.data import apply_transforms, encode_caption, image_transforms, load_image
from mindqwen.multimodal.fusion import (GROUPS, MODES, GroupPolicy, MultimodalLoraConfig, MultimodalQwen,
                                        apply_multimodal_lora, group_of, trainable_by_group)
from mindqwen.multimodal.vision import VIT_HF_KEYS, VisionConfig, load_vit_weights

VISION = dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64)
IMAGE_TOKEN = 7


def _fused(frames=1, cross_layers=(0, 1)):
    lm = from_pretrained(fixture_path("qwen2_tiny", "base"))
    return lm, MultimodalQwen(lm, VisionConfig(**VISION, num_frames=frames), list(cross_layers), IMAGE_TOKEN)


def _inputs(frames=1, batch=2):
    rng = np.random.default_rng(0)
    ids = rng.integers(8, 512, (batch, 12)).astype(np.int32)
    ids[:, 3] = IMAGE_TOKEN
    shape = (batch, 3, 16, 16) if frames == 1 else (batch, frames, 3, 16, 16)
    return Tensor(ids), Tensor(rng.normal(0, 1, shape).astype(np.float32))


@pytest.mark.parametrize("frames", [1, 4])
def test_zero_gate_gives_the_text_model_and_keeps_lm_keys(frames):
    lm = from_pretrained(fixture_path("qwen2_tiny", "base"))
    before = {p.name: p.asnumpy().copy() for p in lm.get_parameters()}
    ids, pixels = _inputs(frames)
    text = lm(ids).asnumpy()
    fused = MultimodalQwen(lm, VisionConfig(**VISION, num_frames=frames), [0, 1], IMAGE_TOKEN)
    assert np.abs(fused(ids, pixels).asnumpy() - text).max() <= 1e-6
    lm_names = [p.name for p in fused.get_parameters() if group_of(p.name) == "text"]
    assert lm_names == list(before)  # same keys, same order: the LM checkpoint loads and saves as is
    assert all(np.array_equal(p.asnumpy(), before[p.name]) for p in lm.get_parameters())
    others = {p.name.split(".")[0] for p in fused.get_parameters() if p.name not in before}
    assert others == {"vision", "projector", "cross_attn"}


def _open_gates_and_adapters(model):
    rng = np.random.default_rng(1)
    for block in model.cross_attn:
        block.gate.set_data(Tensor(np.array([0.5], np.float32)))
    for layer in lora_layers(model).values():  # B starts at zero: give A a gradient too
        layer.lora_b.set_data(Tensor(rng.normal(0, 0.1, layer.lora_b.shape).astype(np.float32)))


def _policy(modes):
    return MultimodalLoraConfig(**{g: GroupPolicy(m, **_targets(g)) for g, m in zip(GROUPS, modes)})


def _assert_trains_exactly(model, modes):
    """frozen: none of the group's parameters train; full: all; lora: exactly its adapters."""
    trained = {p.name for p in model.trainable_params()}
    for g, m in zip(GROUPS, modes):
        names = {p.name for p in model.get_parameters() if group_of(p.name) == g}
        mine = names & trained
        if m == "frozen":
            assert not mine, (modes, g)
        elif m == "full":
            assert mine == names, (modes, g)
        else:
            adapters = {n for n in names if n.endswith((".lora_a", ".lora_b"))
                        or (g == "cross_attention" and n.endswith(".gate"))}
            assert mine == adapters and adapters, (modes, g)


# An L9 orthogonal array: each group takes each mode three times and every pair of groups meets
# every pair of modes once, so nine runs cover every mode of every group and all pairwise
# interactions (the 81 full combinations add nothing: a group's policy touches only its own
# parameters).
L9 = [(0, 0, 0, 0), (0, 1, 1, 1), (0, 2, 2, 2), (1, 0, 1, 2), (1, 1, 2, 0), (1, 2, 0, 1),
      (2, 0, 2, 1), (2, 1, 0, 2), (2, 2, 1, 0)]


@pytest.mark.parametrize("levels", L9, ids=lambda lv: "-".join(MODES[i][0] for i in lv))
def test_each_policy_trains_exactly_its_groups_and_gradients_reach_them(levels):
    modes = [MODES[i] for i in levels]
    _, model = _fused()
    apply_multimodal_lora(model, _policy(modes))
    _assert_trains_exactly(model, modes)
    _open_gates_and_adapters(model)
    params = model.trainable_params()
    expected = {g for g, m in zip(GROUPS, modes) if m != "frozen"}
    assert {group_of(p.name) for p in params} == expected  # frozen groups are absent
    ids, pixels = _inputs()
    grads = ms.grad(lambda i, x: model(i, x, labels=i), grad_position=None, weights=params)(ids, pixels)
    norms = {g: 0.0 for g in expected}
    for p, g in zip(params, grads):
        norms[group_of(p.name)] += float(np.square(g.asnumpy()).sum())
    assert all(v > 0 for v in norms.values()), norms  # every trained group gets a signal


def _targets(group):
    return {"vision": {"target_modules": ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj"]},
            "projector": {"target_modules": ["linear_1", "linear_2"]},
            "text": {"target_modules": ["q_proj", "v_proj"]},
            "cross_attention": {"r": 4}}[group]


def test_trainable_counts_equal_closed_form_image():
    _, model = _fused()
    apply_multimodal_lora(model)  # defaults: vision lora r8 (attention), projector full, text lora r8 (q, v), xattn lora r4
    c = model.config  # qwen2_tiny: hidden 64, 2 layers, KV width 32
    h, kv, dv, lv = c.hidden_size, c.num_key_value_heads * c.head_dim, VISION["hidden_size"], VISION["num_hidden_layers"]
    expected = {
        "vision": lv * 4 * 8 * (dv + dv),
        "projector": (dv * h + h) + (h * h + h),
        "text": c.num_hidden_layers * (8 * (h + h) + 8 * (h + kv)),
        "cross_attention": 2 * (4 * 4 * (h + h) + 1),  # 2 blocks: q/k/v/o LoRA r4 + the gate
    }
    assert trainable_by_group(model) == expected


def test_trainable_counts_equal_closed_form_video_with_distinct_ranks():
    _, model = _fused(frames=4)
    apply_multimodal_lora(model, MultimodalLoraConfig(temporal_r=4))  # spatial r 8 (vision.r), temporal r 4
    dv, lv = VISION["hidden_size"], VISION["num_hidden_layers"]
    counts = trainable_by_group(model)
    spatial = sum(int(p.size) for p in model.trainable_params() if ".attn." in p.name and p.name.startswith("vision."))
    temporal = sum(int(p.size) for p in model.trainable_params() if ".temporal_attn." in p.name)
    assert spatial == lv * 4 * 8 * 2 * dv and temporal == lv * 4 * 4 * 2 * dv
    assert counts["vision"] == spatial + temporal
    ranks = {layer.lora_a.shape[0] for path, layer in lora_layers(model).items() if "temporal_attn" in path}
    assert ranks == {4}


def test_temporal_attention_mixes_frames():
    """Frame 0's features depend on frame 3's pixels only through temporal attention."""
    _, model = _fused(frames=4)
    _, pixels = _inputs(frames=4)
    changed = pixels.asnumpy().copy()
    changed[:, 3] += 1.0
    n = (VISION["image_size"] // VISION["patch_size"]) ** 2
    a = model.vision(pixels).asnumpy()[:, :n]  # (B, T·N, D): frame 0's patches first
    b = model.vision(Tensor(changed)).asnumpy()[:, :n]
    assert np.abs(a - b).max() > 1e-3


def test_hf_vit_weights_load_by_key_map():
    """HF ViT names and layouts: conv kernel (D, 3, p, p) → (D, 3·p·p), CLS position dropped."""
    _, model = _fused()
    rng = np.random.default_rng(2)
    d, p, n = VISION["hidden_size"], VISION["patch_size"], (VISION["image_size"] // VISION["patch_size"]) ** 2
    tensors = {"vit.embeddings.cls_token": rng.normal(size=(1, 1, d)),
               "vit.embeddings.patch_embeddings.projection.weight": rng.normal(size=(d, 3, p, p)),
               "vit.embeddings.position_embeddings": rng.normal(size=(1, n + 1, d))}
    for hf_name, ours in VIT_HF_KEYS.items():
        for i in range(VISION["num_hidden_layers"] if "{i}" in hf_name else 1):
            key = "vit." + hf_name.replace("{i}", str(i))
            if key not in tensors:
                shape = {p_.name: p_.shape for p_ in model.vision.get_parameters()}["vision." + ours.replace("{i}", str(i))]
                tensors[key] = rng.normal(size=shape)
    load_vit_weights(model.vision, tensors, "vit.safetensors")
    params = {q.name: q.asnumpy() for q in model.vision.get_parameters()}
    kernel = tensors["vit.embeddings.patch_embeddings.projection.weight"]
    assert np.allclose(params["vision.patch_embed.weight"], kernel.reshape(d, -1))
    assert np.allclose(params["vision.pos_embed"], tensors["vit.embeddings.position_embeddings"][:, 1:])
    assert np.allclose(params["vision.blocks.1.mlp.fc2.bias"], tensors["vit.encoder.layer.1.output.dense.bias"])
    del tensors["vit.layernorm.bias"]
    tensors["vit.layernorm.weight"] = tensors["vit.layernorm.weight"] + 1
    with pytest.raises(ValueError, match=r"vit.safetensors: missing ViT tensors for \['vision.norm.bias'\]"):
        load_vit_weights(model.vision, tensors, "vit.safetensors")
    with pytest.raises(ValueError, match="vit.safetensors: vit.extra: not a ViT tensor"):
        load_vit_weights(model.vision, {"vit.extra": np.zeros(1)}, "vit.safetensors")
    assert np.array_equal(model.vision.norm.weight.asnumpy(), params["vision.norm.weight"])  # untouched


@pytest.mark.parametrize("size", [(300, 500), (97, 61), (224, 224), (1000, 240)])
def test_transforms_give_3x224x224(size, tmp_path):
    from PIL import Image
    h, w = size
    path = str(tmp_path / "img.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 4), dtype=np.uint8), "RGBA").save(path)
    out = apply_transforms(load_image(path), image_transforms(224))
    assert out.shape == (3, 224, 224) and out.dtype == np.float32
    # A constant grey image normalises to (0.5 - mean) / std per channel.
    grey = apply_transforms(np.full((h, w, 3), 128, np.uint8), image_transforms(224))
    expected = (128 / 255 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    assert np.allclose(grey.mean((1, 2)), expected, atol=1e-5)


def test_corrupt_image_names_the_file(tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(ValueError, match="broken.jpg: cannot read the image"):
        load_image(str(bad))
    with pytest.raises(ValueError, match="missing.png"):
        load_image(str(tmp_path / "missing.png"))


class WordTokenizer:
    """Test double: one id per word (ids from 10), EOS 1, pad 2."""

    eos_token_id, pad_token_id = 1, 2

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(w, 10 + len(self.vocab)) for w in text.split()]


def test_caption_loss_covers_only_the_caption():
    tok = WordTokenizer()
    ids, labels = encode_caption(tok, "a red square", IMAGE_TOKEN, 32)
    kept = ids[labels != -100].tolist()
    assert kept == tok.encode("a red square") + [1]
    assert IMAGE_TOKEN in ids.tolist() and ids.tolist().index(IMAGE_TOKEN) < int(np.argmax(labels != -100))
    with pytest.raises(ValueError, match="do not fit"):
        encode_caption(tok, "word " * 40, IMAGE_TOKEN, 32)



def test_frame_sampling_takes_segment_centres():
    from mindqwen.multimodal.data import sample_frames
    assert sample_frames(10, 4).tolist() == [1, 3, 6, 8]  # ⌊(i + ½)·10/4⌋
    assert sample_frames(16, 16).tolist() == list(range(16))
    assert sample_frames(2, 4).tolist() == [0, 0, 1, 1]  # short videos repeat frames


def test_video_rows_give_t_x_3x224x224(tmp_path):
    """A .npy video and a folder of frames, of any length and size, become (T, 3, 224, 224) rows
    (``MediaColumn``); the loader batches them (B, T, 3, S, S); a bad video names its row and file."""
    from PIL import Image
    from mindqwen.data.loader import BatchLoader, TokenDataset
    from mindqwen.multimodal.data import MediaColumn
    rng = np.random.default_rng(0)
    np.save(tmp_path / "clip.npy", rng.integers(0, 255, (37, 97, 61, 3), dtype=np.uint8))
    (tmp_path / "frames").mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (300, 500, 3), dtype=np.uint8)).save(tmp_path / "frames" / f"{i:03d}.png")
    paths = [str(tmp_path / "clip.npy"), str(tmp_path / "frames")]
    column = MediaColumn(paths, ["a.jsonl:1", "a.jsonl:2"], VisionConfig(**{**VISION, "image_size": 224}, num_frames=4))
    pixels = column[np.arange(2)]
    assert pixels.shape == (2, 4, 3, 224, 224) and pixels.dtype == np.float32
    frames = np.load(tmp_path / "clip.npy")[[4, 13, 23, 32]]  # sample_frames(37, 4)
    expected = np.stack([apply_transforms(f, image_transforms(224)) for f in frames])
    np.testing.assert_array_equal(pixels[0], expected)
    small = MediaColumn(paths, ["a.jsonl:1", "a.jsonl:2"], VisionConfig(**{**VISION, "image_size": 32}, num_frames=2))
    tokens = TokenDataset(np.zeros((2, 32), np.int32), pixel_values=small)
    batch = next(iter(BatchLoader(tokens, 2, shuffle=False).stream(0, 1)))
    assert [b.shape for b in batch] == [(2, 32), (2, 32), (2, 2, 3, 32, 32)]
    (tmp_path / "bad.npy").write_bytes(b"not an array")
    with pytest.raises(ValueError, match="a.jsonl:1: .*bad.npy: cannot read the video"):
        MediaColumn([str(tmp_path / "bad.npy")], ["a.jsonl:1"], VisionConfig(**VISION, num_frames=4))[0]
    np.save(tmp_path / "flat.npy", np.zeros((4, 8, 8), np.uint8))
    with pytest.raises(ValueError, match=r"flat.npy: a video array is \(T, H, W, 3\)"):
        MediaColumn([str(tmp_path / "flat.npy")], ["a.jsonl:1"], VisionConfig(**VISION, num_frames=4))[0]


@pytest.mark.parametrize("frames", [1, 4])
def test_vision_export_matches_the_eager_tower_at_any_batch(frames, tmp_path):
    """vision.mindir (LoRA merged) reproduces the trained, unmerged tower; the batch axis is dynamic."""
    from mindqwen.export.vision import export_vision
    _, model = _fused(frames)
    apply_multimodal_lora(model)
    _open_gates_and_adapters(model)  # non-zero LoRA B: merging changes the weights
    info = export_vision(model, str(tmp_path))
    assert info["parity"]["passed"] and info["parity"]["vs_unmerged_model"] <= 1e-4
    graph = ms.nn.GraphCell(ms.load(str(tmp_path / "vision.mindir")))
    shape = (3, 3, 16, 16) if frames == 1 else (3, frames, 3, 16, 16)
    pixels = Tensor(np.random.default_rng(1).normal(0, 1, shape).astype(np.float32))
    model.set_train(False)
    eager = model.projector(model.vision(pixels)).asnumpy()
    exported = graph(pixels).asnumpy()
    assert exported.shape == (3, frames * 4, model.config.hidden_size)
    np.testing.assert_allclose(exported, eager, atol=1e-4)
    assert info["inputs"][0]["shape"] == [-1] + list(shape[1:])


@pytest.mark.parametrize("policy", ["lora", "full"])
def test_vision_gradients_in_fused_graph_mode_equal_pynative(policy):
    """The ViT's gradients in graph mode with mindqwen's CPU fusion flags equal PyNative's (eager,
    unfused). Measured before the fix: fused Transpose clusters gave block 0's gradients of
    1e11–1e37 (true ≤ 1), so the fused model never learned to see."""
    from mindspore import nn
    from mindqwen import backend
    from mindqwen.lora import LoraConfig, inject_lora
    from mindqwen.multimodal.vision import VisionEncoder
    backend.use_cpu_fusion()
    encoder = VisionEncoder(VisionConfig(**VISION))
    if policy == "lora":
        inject_lora(encoder, LoraConfig(r=8, lora_alpha=16, target_modules=[f"attn.{p}" for p in
                                                                             ("q_proj", "k_proj", "v_proj", "o_proj")]))
        rng = np.random.default_rng(1)
        for p in encoder.get_parameters():
            p.requires_grad = p.name.endswith(("lora_a", "lora_b"))
            if p.name.endswith("lora_b"):
                p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    pixels = Tensor(np.random.default_rng(0).normal(0, 1, (2, 3, 16, 16)).astype(np.float32))

    class Loss(nn.Cell):  # a fixed random projection: the final LayerNorm makes mean(h²) constant
        def __init__(self, m):
            super().__init__()
            self.m = m
            self.w = Tensor(np.random.default_rng(2).normal(0, 1, (2, 4, 32)).astype(np.float32))

        def construct(self, x):
            return (self.m(x) * self.w).sum()

    params, grads = encoder.trainable_params(), {}
    mode = ms.get_context("mode")
    try:
        for m in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
            ms.set_context(mode=m)
            grads[m] = [g.asnumpy() for g in ms.value_and_grad(Loss(encoder), None, params)(pixels)[1]]
    finally:
        ms.set_context(mode=mode)
    # The floor is relative to the largest gradient of the model: a key bias's gradient is 0 in exact
    # arithmetic (it adds q·b to a whole row of scores, which softmax cancels), so both modes give
    # rounding noise of ~1e-9 there, and the noise of either is not a scale for the other.
    floor = 1e-7 * max(float(np.abs(g).max()) for g in grads[ms.PYNATIVE_MODE])
    for p, eager, graph in zip(params, grads[ms.PYNATIVE_MODE], grads[ms.GRAPH_MODE]):
        scale = float(np.abs(eager).max())
        assert float(np.abs(graph - eager).max()) <= 1e-4 * scale + floor, (p.name, scale, np.abs(graph).max(), floor)


SMALL_SHAPES = ["multimodal.shapes.train_images=64", "multimodal.shapes.eval_images=16", "multimodal.text_steps=2",
                "multimodal.vision_steps=2", "trainer.micro_batch_size=4", "trainer.progress=false",
                "trainer.warmup_steps=1", "export.enabled=false"]


@pytest.mark.slow
def test_shapes_demo_learns_to_caption_and_exports(tmp_path):
    """The reduced demo through the recipe path a user runs: held-out caption exact match (chance
    ≈ 1/48) rises by at least 30 points through the fused stage alone; the export's LM and
    vision graphs pass their parity checks."""
    from mindqwen.train.recipe import load_recipe
    from mindqwen.tasks import train_recipe
    summary = train_recipe(load_recipe("multimodal/shapes", [
        "multimodal.shapes.train_images=2000", "multimodal.text_steps=150", "multimodal.vision_steps=400",
        "trainer.max_steps=300", "trainer.progress=false", f"trainer.output_dir={tmp_path}"]))
    before, after = summary["caption_exact_match_before"], summary["caption_exact_match_after"]
    assert before < 0.1 and after >= before + 0.30, (before, after)
    export = summary["export"]
    assert export["vision_parity"]["passed"] and export["lm_parity"]["passed"] and export["image_parity"]["passed"]
    assert (tmp_path / "export" / "image" / "image_kv.mindir").is_file()
    assert (tmp_path / "export" / "vision.mindir").is_file()
    assert (tmp_path / "export" / "lm" / "decode.mindir").is_file()


def test_multimodal_recipe_with_o2_recompute_accumulation_resumes_bit_identical(tmp_path):
    """The fused stage through ``fit`` with fp16 O2, full recompute and 2 accumulated
    micro-batches: a run resumed at step 2 (its stages loaded from their own checkpoints, not
    re-run) ends with the same losses and the same bytes as the uninterrupted run."""
    import json
    import os
    import shutil
    from mindqwen.train.recipe import load_recipe
    from mindqwen.tasks import train_recipe
    settings = SMALL_SHAPES + ["trainer.max_steps=4", "trainer.save_every=2", "trainer.precision.level=O2",
                               "trainer.recompute=full", "trainer.gradient_accumulation=2",
                               "multimodal.vision_steps=0"]  # one preparatory stage is enough here
    straight = train_recipe(load_recipe("multimodal/shapes", settings + [f"trainer.output_dir={tmp_path / 'a'}"]))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_00000004")  # as if killed after step 3
    resumed = train_recipe(load_recipe("multimodal/shapes", settings + [
        f"trainer.output_dir={tmp_path / 'b'}", "trainer.resume=auto"]))

    def losses(folder):
        return [json.loads(line)["loss"] for line in open(folder / "metrics.jsonl")]

    assert losses(tmp_path / "b") == losses(tmp_path / "a") and len(losses(tmp_path / "a")) == 4
    assert len(losses(tmp_path / "b" / "text")) == 2  # the text stage was loaded, not trained again
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (open(tmp_path / run / "checkpoints" / "step_00000004" / name, "rb").read() for run in "ab")
        assert a == b, name
    assert resumed["caption_exact_match_after"] == straight["caption_exact_match_after"]
    assert straight["train"]["overflow_count"] == 0 and os.path.isfile(tmp_path / "a" / "summary.json")

    # what `mindqwen export <recipe>` rebuilds: the fused stage's trained tensors are the checkpoint's
    from mindqwen.io.safetensors import SafetensorsFile
    from mindqwen.tasks import task_for
    rebuilt = {p.name: p.asnumpy() for p in task_for(load_recipe("multimodal/shapes", settings + [
        f"trainer.output_dir={tmp_path / 'b'}"])).trained_model().get_parameters()}
    ckpt = SafetensorsFile(str(tmp_path / "a" / "checkpoints" / "step_00000004" / "model.safetensors"))
    assert len(list(ckpt.keys())) > 10
    for name in ckpt.keys():
        np.testing.assert_array_equal(rebuilt[name], ckpt.get(name), err_msg=name)


def test_shapes_recipe_validates_and_refuses_what_it_cannot_use_with_the_reason():
    from mindqwen.train.recipe import RecipeError
    from mindqwen.tasks import validate_recipe
    report = validate_recipe("multimodal/shapes", ["trainer.recompute=full", "trainer.precision.level=O2"])
    assert "vision lora (8,192)" in report and "cross_attention full" in report and "precision O2" in report
    with pytest.raises(RecipeError, match=r"a multimodal recipe cannot use lora \(LoRA is set per group"):
        validate_recipe("multimodal/shapes", ["lora.r=8"])
    with pytest.raises(RecipeError, match=r"parallel \(the layouts .* cover the LM alone"):
        validate_recipe("multimodal/shapes", ["parallel.data_parallel=2"])
    with pytest.raises(RecipeError, match="multimodal.policy.text: policy mode must be one of"):
        validate_recipe("multimodal/shapes", ["multimodal.policy.text.mode=half"])
    with pytest.raises(RecipeError, match="multimodal.policy: text: .*matches no module"):
        validate_recipe("multimodal/shapes", ["multimodal.policy.text.target_modules=[nope]"])
