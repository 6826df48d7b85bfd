"""Greedy generation through a mindqwen export folder, without mindqwen: prefill, then decode.

Copied into every export folder. Backends:
  mindspore  the .mindir graphs through ``ms.load`` + ``nn.GraphCell`` (any machine)
  lite       the converter_lite outputs in lite/ through MindSpore Lite (an Ascend 310/310P/910 board)

    python run_exported.py EXPORT_DIR --prompt-ids 483,320,350 --max-new-tokens 32
    python run_exported.py EXPORT_DIR --backend lite --device-id 0 --prompt "你好" (needs tokenizer/)
    python run_exported.py IMAGE_EXPORT_DIR --image cat.png --prompt-ids ...  (image-conditioned)

Prompts are left-padded to the smallest exported sequence bucket (Lite gears are fixed shapes)
and the batch is filled up to the smallest exported batch size with copies of the first row.
The KV cache goes in and out of every call (stacked [layers, batch, kv_heads, slot, head_dim]),
and so do a hybrid model's linear-attention states (``"states"`` in the manifest: fixed size, zeros
before prefill); such a model has one prefill graph per bucket, ``prefill_<S>``.

An image-conditioned export (``"image"`` in the manifest) runs ``image_kv`` first: the pixels
(``--pixels`` a .npy (B, …) already transformed, or ``--image`` a file transformed here with
mindspore.dataset as the manifest says) become the cross-attention keys and values, which every
prefill and decode call then reads, with ``vision_mask`` 1 from the image token on.
"""
import argparse
import json
import os
import sys

import numpy as np


class MindSporeGraphs:
    def __init__(self, folder, manifest, device_id):
        import mindspore as ms
        from mindspore import nn
        ms.set_context(mode=ms.GRAPH_MODE)
        self.ms = ms
        self.graphs = {n: nn.GraphCell(ms.load(os.path.join(folder, g["file"])))
                       for n, g in manifest["graphs"].items()}

    def __call__(self, name, arrays):
        outs = self.graphs[name](*[self.ms.Tensor(a) for a in arrays])
        return [o.asnumpy() for o in outs]


class LiteGraphs:
    def __init__(self, folder, manifest, device_id):
        import mindspore_lite as mslite
        context = mslite.Context()
        context.target = ["ascend"]
        context.ascend.device_id = device_id
        self.models, self.shapes = {}, {}
        for name, path in manifest["lite"]["outputs"].items():
            model = mslite.Model()
            model.build_from_file(os.path.join(folder, path), mslite.ModelType.MINDIR, context)
            self.models[name], self.shapes[name] = model, None

    def __call__(self, name, arrays):
        model = self.models[name]
        inputs = model.get_inputs()
        shapes = [list(a.shape) for a in arrays]
        if shapes != self.shapes[name]:  # pick the gear
            model.resize(inputs, shapes)
            self.shapes[name] = shapes
        for tensor, a in zip(inputs, arrays):
            tensor.set_data_from_numpy(np.ascontiguousarray(a))
        return [o.get_data_to_numpy() for o in model.predict(inputs)]


def generate(run, manifest, prompts, max_new_tokens, pixels=None):
    """Greedy tokens (B, N) and the logits of every step (N, B, V); ``pixels`` (B, …): one image
    per prompt for an image-conditioned export."""
    rows = len(prompts)
    batch = min([b for b in manifest["batch_sizes"] if b >= rows] or [rows])
    prompts = list(prompts) + [prompts[0]] * (batch - rows)
    image = manifest.get("image")
    if (image is None) != (pixels is None):
        sys.exit("an image-conditioned export needs --pixels or --image" if image else "this export takes no image")
    if image is not None:
        if list(pixels.shape[1:]) != image["pixel_shape"][1:] or len(pixels) != rows:
            sys.exit(f"pixels of shape {list(pixels.shape)}: the export takes one row per prompt ({rows}) of "
                     f"{image['pixel_shape'][1:]}")
        if any(image["token_id"] not in p for p in prompts):
            sys.exit(f"every prompt needs the image token {image['token_id']}: text from it on sees the image")
    longest = max(len(p) for p in prompts)
    fits = [s for s in manifest["seq_buckets"] if s >= longest]
    max_len = manifest["max_seq_len"]
    if not fits or longest + max_new_tokens > max_len:
        sys.exit(f"prompt of {longest} tokens + {max_new_tokens} new does not fit the export "
                 f"(buckets {manifest['seq_buckets']}, max_seq_len {max_len})")
    s = fits[0]
    ids = np.zeros((batch, s), np.int32)
    mask = np.zeros((batch, max_len), np.int32)
    for i, p in enumerate(prompts):
        ids[i, s - len(p):], mask[i, s - len(p):s] = p, 1
    positions = np.maximum(np.cumsum(mask[:, :s], 1) - 1, 0).astype(np.int32)
    shape = [d if d >= 0 else batch for d in manifest["cache"]["shape"]]
    cache = np.zeros(shape, {"float32": np.float32, "float16": np.float16}[manifest["dtype"]])
    states = [np.zeros([d if d >= 0 else batch for d in st["shape"]], np.float32) for st in manifest.get("states", [])]
    prefill = "prefill" if "prefill" in manifest["graphs"] else f"prefill_{s}"
    slots = np.tile(np.arange(s, dtype=np.int32), (batch, 1))  # (B, S): every row fills 0..S-1
    extra = []
    if image is not None:  # the image's keys/values once; tokens from the image token on see them
        pixels = np.concatenate([pixels, np.repeat(pixels[:1], batch - rows, 0)]).astype(np.float32)
        image_k, image_v = run("image_kv", [pixels])
        sees = ((np.cumsum(ids == image["token_id"], 1) > 0) & (mask[:, :s] > 0)).astype(np.float32)
        extra, seen = [image_k, image_v], sees[:, -1:, None]
    logits, k, v, *states = run(prefill, [ids, positions, mask, slots, cache, cache] + states + extra
                                + ([sees[:, :, None]] if image is not None else []))
    eos = manifest["generation"].get("eos_token_id")
    eos = set(np.atleast_1d(eos).tolist()) if eos is not None else set()
    tokens, steps, done = [], [], np.zeros(batch, bool)
    pos = positions[:, -1:] + 1
    for i in range(max_new_tokens):
        steps.append(logits[:rows])
        nxt = logits.argmax(-1).astype(np.int32)
        tokens.append(nxt[:rows])
        done |= np.isin(nxt, list(eos))
        if done[:rows].all() or i == max_new_tokens - 1:
            break
        mask[:, s + i] = 1
        if image is not None:
            seen = np.maximum(seen, (nxt == image["token_id"]).astype(np.float32)[:, None, None])
        logits, k, v, *states = run("decode", [nxt[:, None], pos + i, mask, np.full((batch, 1), s + i, np.int32),
                                               k, v] + states + (extra + [seen] if image is not None else []))
    return np.stack(tokens, 1), np.stack(steps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="a mindqwen export folder (manifest.json)")
    p.add_argument("--backend", choices=["mindspore", "lite"], default="mindspore")
    p.add_argument("--device-id", type=int, default=0)
    p.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--prompts", help="JSON file: a list of token-id lists (one batch)")
    p.add_argument("--prompt", help="text (needs tokenizer/ in the export and sentencepiece or tokenizers)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--pixels", help="image-conditioned export: .npy pixel values, one row per prompt")
    p.add_argument("--image", help="image-conditioned export: an image file (needs mindspore.dataset and PIL)")
    p.add_argument("--dump", help="write tokens and per-step logits to this .npz")
    a = p.parse_args(argv)
    with open(os.path.join(a.folder, "manifest.json")) as f:
        manifest = json.load(f)
    tokenizer = load_tokenizer(a.folder, manifest) if a.prompt is not None else None
    if a.prompts:
        with open(a.prompts) as f:
            prompts = json.load(f)
    elif a.prompt_ids:
        prompts = [[int(t) for t in a.prompt_ids.split(",")]]
    elif tokenizer is not None:
        encoded = tokenizer.encode(a.prompt)
        prompts = [getattr(encoded, "ids", encoded)]  # tokenizers returns an Encoding
    else:
        sys.exit("give --prompt-ids, --prompts or --prompt")
    pixels = np.load(a.pixels) if a.pixels else load_image(a.image, manifest) if a.image else None
    backend = MindSporeGraphs if a.backend == "mindspore" else LiteGraphs
    tokens, logits = generate(backend(a.folder, manifest, a.device_id), manifest, prompts, a.max_new_tokens, pixels)
    if a.dump:
        np.savez(a.dump, tokens=tokens, logits=logits)
    for row in tokens.tolist():
        print(json.dumps({"tokens": row, "text": tokenizer.decode(row) if tokenizer else None}, ensure_ascii=False))


def load_image(path, manifest):
    """An image file as (1, 3, S, S) pixels: the training transforms, listed in the manifest."""
    import mindspore.dataset.transforms as T
    import mindspore.dataset.vision as V
    from PIL import Image
    t = manifest["image"]["transforms"]
    with Image.open(path) as img:
        rgb = np.asarray(img.convert("RGB"), np.uint8)
    ops = T.Compose([V.Resize(t["resize"]), V.CenterCrop(t["center_crop"]), V.Rescale(t["rescale"], 0.0),
                     V.Normalize(t["mean"], t["std"]), V.HWC2CHW()])
    return np.asarray(ops(rgb), np.float32)[None]


def load_tokenizer(folder, manifest):
    files = [os.path.join(folder, f) for f in (manifest.get("tokenizer") or {}).get("files", [])]
    for path in files:
        if path.endswith(".model"):
            import sentencepiece
            return sentencepiece.SentencePieceProcessor(model_file=path)
        if path.endswith("tokenizer.json"):
            from tokenizers import Tokenizer
            return Tokenizer.from_file(path)
    sys.exit("this export has no tokenizer (tokenizer/*.model or tokenizer.json): use --prompt-ids")


if __name__ == "__main__":
    main()
