"""``mindqwen <command>``: a dictionary of subcommands to ordinary functions.

Every command takes ``--help`` (with a worked example). Known errors print one line naming the
file, key or tensor, and exit non-zero (``--debug`` shows the traceback); an unexpected error
keeps its traceback. Exit codes: 0 success, 1 bad input (recipe, config, data, checkpoint,
adapter, out of memory), 2 bad command line, 3 training diverged.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Callable, Dict, List, Optional

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_DIVERGED = 0, 1, 2, 3


def _parser(command: Callable, example: str) -> argparse.ArgumentParser:
    name = command.__name__[len("cmd_"):]
    return argparse.ArgumentParser(prog=f"mindqwen {name}", description=command.__doc__,
                                   epilog=f"example:\n  {example}", formatter_class=argparse.RawDescriptionHelpFormatter)


def _load_model(folder: str, adapter: Optional[str] = None):
    from mindqwen import from_pretrained, load_adapter
    model = from_pretrained(folder)
    return load_adapter(model, adapter) if adapter else model


def cmd_train(argv: List[str]) -> None:
    """Run a training recipe end to end (data, model, training, evaluation, adapter, export)."""
    p = _parser(cmd_train, "mindqwen train recipes/demo/demo.yaml trainer.max_steps=100 lora.r=16")
    p.add_argument("recipe", help="recipe YAML, or a bundled recipe's name (`mindqwen recipes ls`)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--skip-bad", action="store_true", help="multimodal data: leave out bad records (counted) "
                                                           "instead of stopping at the first (data.skip_bad=true)")
    args = p.parse_intermixed_args(argv)  # overrides may follow options
    from mindqwen.train.recipe import find_recipe, load_recipe
    from mindqwen.tasks import train_recipe
    if args.skip_bad:
        args.overrides.append("data.skip_bad=true")
    path = find_recipe(args.recipe)
    recipe = load_recipe(path, args.overrides)
    with open(path, encoding="utf-8-sig") as f:
        text = f.read() + "".join(f"\n# override: {o}" for o in args.overrides)
    summary = train_recipe(recipe, text, path)
    outputs = {**summary["train"]["outputs"], "export": summary.get("export", {}).get("folder")}
    if "loss_curve" in outputs and outputs["loss_curve"] is None:
        outputs["loss_curve"] = "none (pip install matplotlib)"
    print(f"outputs in {summary['output_dir']}: summary.json, metrics.jsonl; " + ", ".join(f"{k}: {v}" for k, v in outputs.items() if v))


def cmd_eval(argv: List[str]) -> None:
    """Score a model: standard benchmarks through lm-evaluation-harness (--tasks), or validation
    loss, perplexity and exact match on your own data (--data)."""
    p = _parser(cmd_eval, "mindqwen eval ./Qwen2.5-0.5B-Instruct --tasks hellaswag,mmlu --num-fewshot 5 --limit 200 "
                          "--output results.json\n"
                          "  mindqwen eval outputs/demo/pretrain/model --adapter outputs/demo/adapter "
                          "--data outputs/demo/data/eval.jsonl --tokenizer outputs/demo/data/tokenizer.model")
    p.add_argument("model", help="HF folder")
    p.add_argument("--adapter", help="PEFT adapter folder to load on top")
    p.add_argument("--tokenizer", help="HF tokenizer folder, qwen.tiktoken or SentencePiece .model "
                                       "(default: the model folder's)")
    p.add_argument("--batch-size", type=int, default=8)
    tasks = p.add_argument_group("benchmarks (lm-evaluation-harness; pip install 'mindqwen[eval]')")
    tasks.add_argument("--tasks", help="comma-separated task or group names (hellaswag,mmlu,...)")
    tasks.add_argument("--num-fewshot", type=int, help="examples before each question (default: each task's)")
    tasks.add_argument("--limit", type=float, help="examples per task (a number, or a fraction below 1)")
    tasks.add_argument("--include-path", help="folder of your own task YAML files")
    tasks.add_argument("--apply-chat-template", action="store_true", help="wrap prompts in the model's chat template")
    tasks.add_argument("--fewshot-as-multiturn", action="store_true", help="few-shot examples as chat turns")
    tasks.add_argument("--max-length", type=int, help="context length (default: the model's)")
    tasks.add_argument("--output", help="write the full results (JSON)")
    tasks.add_argument("--log-samples", action="store_true", help="with --output: every request and answer too")
    data = p.add_argument_group("your own data")
    data.add_argument("--data", help=".jsonl prompt/response pairs, .npy token rows, or a `mindqwen preprocess` folder")
    data.add_argument("--seq-length", type=int, default=256)
    args = p.parse_args(argv)
    if (args.tasks is None) == (args.data is None):
        raise ValueError("give --tasks (benchmarks through lm-evaluation-harness) or --data (your own data)")
    (_eval_tasks if args.tasks is not None else _eval_data)(args)


def _eval_tasks(args: argparse.Namespace) -> None:
    """``mindqwen eval --tasks``: checked before the model loads; the scores as a table."""
    from mindqwen.harness import MindQwenLM, check_tasks, evaluate_tasks, write_results
    from lm_eval.utils import make_table
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    check_tasks(tasks, args.include_path, args.limit)
    lm = MindQwenLM(args.model, tokenizer=args.tokenizer, adapter=args.adapter, batch_size=args.batch_size,
                    max_length=args.max_length)
    results = evaluate_tasks(lm, tasks, args.num_fewshot, args.limit, args.include_path, args.apply_chat_template,
                             args.fewshot_as_multiturn, log_samples=args.log_samples)
    print(make_table(results))
    if args.output:
        write_results(args.output, results)
        print(f"results in {args.output}")


def _eval_data(args: argparse.Namespace) -> None:
    """``mindqwen eval --data``: loss and perplexity (and exact match for prompt/response data)."""
    import math
    from mindqwen.data.sources import load_split
    from mindqwen.evaluate import exact_match
    from mindqwen.data.tokenizer import model_tokenizer
    from mindqwen.train.loop import evaluate
    tokenizer = model_tokenizer(args.model, args.tokenizer, required=args.data.endswith(".jsonl"))
    data, pairs = load_split(args.data, tokenizer, args.seq_length)
    model = _load_model(args.model, args.adapter)
    loss = evaluate(model, data, min(args.batch_size, len(data)))
    print(f"loss {loss:.4f}  perplexity {math.exp(min(loss, 50)):.3f}  ({len(data)} examples)")
    if pairs:
        longest = max(len(tokenizer.encode(r)) for _, r in pairs)
        accuracy, _ = exact_match(model, tokenizer, pairs, longest + 1)
        print(f"exact match {accuracy:.1%}")


def cmd_generate(argv: List[str]) -> None:
    """Generate from an HF folder with the KV cache (optionally with a LoRA adapter), or from a
    finished multimodal recipe run about an image or video, streaming."""
    p = _parser(cmd_generate, "mindqwen generate tests/fixtures/qwen2_tiny/base --input-ids 483,320,350 "
                              "--max-new-tokens 16\n"
                              "  mindqwen generate multimodal/shapes --image outputs/multimodal/data/eval/00000.png")
    p.add_argument("model", help="HF folder: config.json + model.safetensors; or a multimodal recipe (file or "
                                 "bundled name) whose run has finished, with --image")
    p.add_argument("overrides", nargs="*", help="recipe key=value overrides (with a recipe)")
    p.add_argument("--image", help="multimodal: the image (a video model: .npy clip or frames folder); the "
                                   "prompt (default 'Describe the image.') follows it in a user turn")
    p.add_argument("--adapter", help="PEFT adapter folder to load on top")
    p.add_argument("--input-ids", help="comma-separated prompt token ids")
    p.add_argument("--prompt", help="prompt text (needs --tokenizer)")
    p.add_argument("--tokenizer", help="SentencePiece .model, tokenizer folder or qwen.tiktoken")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; needs --tokenizer)")
    p.add_argument("--seed", type=int, help="sampling seed")
    args = p.parse_intermixed_args(argv)
    from mindqwen.data.tokenizer import load_tokenizer
    from mindqwen.generation import GenerationConfig, Generator
    if args.image is not None or args.model.endswith((".yaml", ".yml")):
        model, tokenizer, prompt, image = _multimodal_prompt(args)
        images = [image]
    elif args.overrides:
        raise ValueError(f"key=value overrides go with a recipe, not an HF folder: {' '.join(args.overrides)}")
    else:
        model, images = _load_model(args.model, args.adapter), None
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    if images is not None:
        pass  # the prompt is the recipe's chat turn around the image
    elif args.prompt is not None:
        if tokenizer is None:
            raise ValueError("--prompt needs --tokenizer (or give --input-ids)")
        prompt = tokenizer.encode(args.prompt)
    elif args.input_ids:
        try:
            prompt = [int(t) for t in args.input_ids.split(",")]
        except ValueError:
            raise ValueError(f"--input-ids must be comma-separated integers, got {args.input_ids!r}") from None
    else:
        raise ValueError("give --prompt (with --tokenizer) or --input-ids")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, stop_strings=args.stop,
                              eos_token_id=tokenizer.eos_token_id if tokenizer else None, seed=args.seed)
    generator = Generator(model, tokenizer)
    shown = args.prompt if args.prompt is not None else prompt
    print("prompt:   ", shown if images is None else f"<image {args.image}> {args.prompt or 'Describe the image.'}")
    if tokenizer is None:
        print("generated:", generator.run([prompt], config, progress=True, images=images)[0].tokens)
        return
    print("generated: ", end="", flush=True)
    row = generator.run([prompt], config, on_token=lambda _r, _t, text: print(text, end="", flush=True),
                        images=images)[0]
    print(f"\n({len(row.tokens)} tokens, finish reason: {row.finish_reason})")


def _multimodal_prompt(args):
    """``mindqwen generate <recipe> --image …``: the run's fused model, its tokenizer, the prompt
    ids (the image token, then the prompt, in the recipe's chat template) and the pixels."""
    from mindqwen.data.tokenizer import load_tokenizer
    from mindqwen.multimodal.data import PROMPT, encode_prompt, load_pixels
    from mindqwen.tasks import task_for
    from mindqwen.train.recipe import find_recipe, load_recipe
    recipe = load_recipe(find_recipe(args.model), args.overrides)
    if recipe.multimodal is None or args.image is None:
        raise ValueError(f"{args.model}: images go with a multimodal recipe's run and --image; a text model is an "
                         "HF folder")
    if args.adapter or args.input_ids:
        raise ValueError("--adapter and --input-ids are for HF folders; a multimodal run takes --image and --prompt")
    task = task_for(recipe)
    model = task.trained_model()
    tokenizer = load_tokenizer(args.tokenizer or task.tokenizer_file())
    prompt = encode_prompt(tokenizer, model.image_token_id, args.prompt or PROMPT, recipe.multimodal.template)
    return model, tokenizer, prompt, load_pixels(args.image, recipe.multimodal.vision)


def cmd_export(argv: List[str]) -> None:
    """Export prefill + decode MindIR graphs, converter_lite configs and a parity report, from an
    HF folder (with the flags below) or from a finished recipe run (with its export section)."""
    p = _parser(cmd_export, "mindqwen export tests/fixtures/qwen2_tiny/base --output out/export "
                            "--batch-sizes 1,4,8 --max-seq-len 2048 --dtype float16 --target Ascend310\n"
                            "  mindqwen export recipes/demo/demo.yaml    # what `mindqwen train` of it trained")
    p.add_argument("model", help="HF folder, or a recipe (file or bundled name) whose run has finished")
    p.add_argument("overrides", nargs="*", help="recipe key=value overrides (with a recipe)")
    p.add_argument("--adapter", help="PEFT adapter folder, merged into the exported graphs")
    p.add_argument("--output", help="export folder, replaced atomically (default with a recipe: "
                                    "<output_dir>/export)")
    p.add_argument("--batch-sizes", help="comma-separated batch sizes (converter gears; default 1)")
    p.add_argument("--max-seq-len", type=int, help="KV-cache length: prompt + new tokens (default 2048)")
    p.add_argument("--seq-buckets", help="comma-separated prompt-length gears (default 64, 128, …)")
    p.add_argument("--dtype", choices=["float32", "float16"], help="default float32")
    p.add_argument("--target", help="Ascend310 (default) | Ascend310P | Ascend910 | Ascend910B")
    p.add_argument("--precision-mode", help="ge.exec.precision_mode (default: by dtype)")
    p.add_argument("--tokenizer", action="append", default=[], help="tokenizer file to ship (repeatable)")
    args = p.parse_args(argv)
    folder_only = ("adapter", "batch_sizes", "max_seq_len", "seq_buckets", "dtype", "target", "precision_mode",
                   "tokenizer")
    if not os.path.isdir(args.model):
        from mindqwen.train.recipe import find_recipe, load_recipe
        from mindqwen.tasks import export_recipe
        given = [f for f in folder_only if getattr(args, f)]
        if given:
            p.error(f"--{given[0].replace('_', '-')} is for an HF folder; a recipe's export settings are "
                    "recipe keys (export.*, override them as key=value)")
        path = find_recipe(args.model)
        report = export_recipe(load_recipe(path, args.overrides), args.output)
        print(f"wrote {report['folder']} from {path}")
        return
    if args.overrides:
        p.error(f"key=value overrides ({args.overrides[0]}) are for a recipe, not an HF folder")
    if not args.output:
        p.error("--output is required with an HF folder")
    from mindqwen.export import export_model
    args.target = args.target or "Ascend310"
    model = _load_model(args.model, args.adapter)
    manifest = export_model(model, args.output, _ints(args.batch_sizes or "1", "--batch-sizes"),
                            args.max_seq_len or 2048,
                            _ints(args.seq_buckets, "--seq-buckets") if args.seq_buckets else None,
                            args.dtype or "float32", args.target, args.precision_mode, args.tokenizer)
    with open(os.path.join(args.output, "parity.json"), encoding="utf-8") as f:
        parity = json.load(f)
    files = ", ".join(g["file"] for g in manifest["graphs"].values())
    print(f"wrote {args.output}: {files}, manifest.json, lite/ ({args.target})")
    same, full = parity["eager_same_steps"], parity["full_recompute"]
    print(f"parity ({parity['new_tokens']} greedy steps, batch {parity['batch_size']}, fresh process): "
          f"vs eager steps max |Δlogit| = {same['max_abs_logit_diff']:.1e}, vs full recompute "
          f"{full['max_abs_logit_diff']:.1e}; tokens identical = {same['tokens_identical'] and full['tokens_identical']}")
    converted = "converted" if manifest["lite"]["converted"] else "converter_lite is not on PATH; on the target run"
    print(f"{converted}: sh {args.output}/lite/convert.sh")


def _ints(text: str, flag: str) -> List[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def cmd_serve(argv: List[str]) -> None:
    """Serve a model over HTTP (OpenAI-style /v1/completions, /v1/chat/completions) with continuous batching."""
    p = _parser(cmd_serve, "mindqwen serve Qwen2.5-0.5B-Instruct/ --tokenizer Qwen2.5-0.5B-Instruct/ --port 8000\n"
                           "  mindqwen serve recipes/multimodal/shapes.yaml   # a finished multimodal run: image_url parts")
    p.add_argument("model", help="HF folder; or a multimodal recipe (file or bundled name) whose run has finished")
    p.add_argument("overrides", nargs="*", help="recipe key=value overrides (with a multimodal recipe)")
    p.add_argument("--tokenizer", help="SentencePiece .model, tokenizer folder or qwen.tiktoken (an HF folder needs "
                                       "it; a multimodal run has its own)")
    p.add_argument("--adapter", help="PEFT adapter folder to load on top")
    p.add_argument("--recipe", help="recipe whose generation and serve sections give the defaults")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-queue", type=int)
    p.add_argument("--chat-template", choices=["qwen2.5", "qwen3"],
                   help="default qwen2.5; a multimodal run: its recipe's multimodal.template")
    p.add_argument("--model-name", default="mindqwen", help="the id /v1/models lists and responses carry")
    p.add_argument("--api-key", default=os.environ.get("MINDQWEN_API_KEY"),
                   help="require Authorization: Bearer <key> (default: $MINDQWEN_API_KEY; unset: no key)")
    args = p.parse_intermixed_args(argv)
    from mindqwen.data.tokenizer import load_tokenizer
    from mindqwen.generation import Generator, OutputFilter
    from mindqwen.serve import Server
    from mindqwen.train.recipe import Recipe, load_recipe
    template = args.chat_template
    if args.model.endswith((".yaml", ".yml")) or not os.path.isdir(args.model):  # a multimodal run
        from mindqwen.tasks import task_for
        from mindqwen.train.recipe import RecipeError, find_recipe
        try:
            path = find_recipe(args.model)
        except RecipeError:
            raise ValueError(f"{args.model}: neither an HF folder nor a recipe (file or bundled name)") from None
        recipe = load_recipe(path, args.overrides)
        if recipe.multimodal is None or args.adapter:
            raise ValueError(f"{args.model}: serve an HF folder (with --adapter), or a finished multimodal recipe run")
        task = task_for(recipe, path)
        model, tokenizer = task.trained_model(), args.tokenizer or task.tokenizer_file()
        template = template or recipe.multimodal.template
        recipe = load_recipe(args.recipe) if args.recipe else recipe
    else:
        if not args.tokenizer or args.overrides:
            raise ValueError("serving an HF folder needs --tokenizer (and takes no key=value overrides)")
        model, tokenizer = _load_model(args.model, args.adapter), args.tokenizer
        recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    s, g = recipe.serve, recipe.generation
    block = OutputFilter(g.output_filter.block, g.output_filter.action) if g.output_filter.block else None
    generator = Generator(model, load_tokenizer(tokenizer), block)
    server = Server(generator, args.host or s.host, args.port if args.port is not None else s.port,
                    args.max_batch_size or s.max_batch_size, args.max_queue or s.max_queue, s.max_prompt_tokens,
                    g.config(), template or "qwen2.5", args.model_name, args.api_key, s.max_connections,
                    s.max_body_bytes, s.keep_alive_s, s.log_prompts, s.allowed_local_media_path)
    host, port = server.address
    print(f"serving {args.model_name} on http://{host}:{port} (POST /v1/completions, /v1/chat/completions; "
          f"GET /v1/models, /health){'; API key required' if args.api_key else ''}", flush=True)
    server.serve_forever()


FORMATS = ["hf", "mindqwen", "ms-ckpt", "mindformers", "mindformers-mcore"]


def _add_source_format(p: argparse.ArgumentParser) -> None:
    """--from / --config / --qkv / --mlp: how to read a checkpoint that is not an HF folder."""
    p.add_argument("--from", dest="src", choices=FORMATS, help="source format (default: hf for a folder, else ms-ckpt)")
    p.add_argument("--config", help="HF folder or config.json of the model (needed unless the source is an HF folder)")
    p.add_argument("--qkv", choices=["contiguous", "interleaved"], help="mindformers side: fused q/k/v layout")
    p.add_argument("--mlp", choices=["contiguous", "interleaved"], help="mindformers side: fused gate/up layout")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="stored dtype (default: as read)")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="read tensors holding NaN or inf (default: an error naming the tensor)")


def _source_format(args, source: str) -> str:
    """The source format, defaulted; fills --config from an HF folder source."""
    src = args.src or ("hf" if os.path.isdir(source) else "ms-ckpt")
    if args.config is None and src in ("hf", "mindqwen") and os.path.isdir(source):
        args.config = source
    if args.config is None:
        raise ValueError(f"reading {source} ({src}) needs --config (the HF folder or config.json it belongs to)")
    return src


def cmd_convert(argv: List[str]) -> None:
    """Convert checkpoints between HF, MindSpore .ckpt and mindformers (legacy, Mcore) namings."""
    p = _parser(cmd_convert, "mindqwen convert tests/fixtures/qwen2_tiny/base out/model.ckpt --to ms-ckpt\n"
                             "  mindqwen convert mf.ckpt out/hf --from mindformers --qkv interleaved --mlp interleaved "
                             "--config tests/fixtures/qwen2_tiny/base --dtype bf16")
    p.add_argument("source", help="HF folder, .safetensors or .ckpt")
    p.add_argument("target", help="HF folder (--to hf), or a .ckpt / .safetensors file")
    p.add_argument("--to", dest="dst", choices=FORMATS, help="target format (default: ms-ckpt for a .ckpt target, else hf)")
    _add_source_format(p)
    p.add_argument("--max-shard-size", default="5GB", help="HF output: shard above this size")
    args = p.parse_args(argv)
    from mindqwen.io.convert import convert
    src = _source_format(args, args.source)
    dst = args.dst or ("ms-ckpt" if args.target.endswith(".ckpt") else "hf")
    convert(args.source, args.target, src, dst, args.config, args.dtype, args.qkv, args.mlp, args.max_shard_size,
            args.allow_non_finite)
    print(f"wrote {args.target} ({dst})")


def cmd_merge(argv: List[str]) -> None:
    """Merge a PEFT LoRA adapter into its base model (any supported format) and save an HF folder."""
    p = _parser(cmd_merge, "mindqwen merge tests/fixtures/qwen2_tiny/base tests/fixtures/qwen2_tiny/lora_adapter "
                           "out/merged\n  mindqwen merge base.ckpt adapter/ out/merged --from mindformers "
                           "--config path/to/hf_folder")
    p.add_argument("model", help="base checkpoint: HF folder, .ckpt or .safetensors")
    p.add_argument("adapter", help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("output", help="HF folder to write")
    _add_source_format(p)
    args = p.parse_args(argv)
    from mindqwen import load_adapter, merge_and_unload
    from mindqwen.io.convert import DTYPE_ALIASES
    from mindqwen.models.qwen import QwenForCausalLM
    model = QwenForCausalLM.from_checkpoint(args.model, _source_format(args, args.model), args.config, args.qkv,
                                            args.mlp, args.allow_non_finite)
    merged = merge_and_unload(load_adapter(model, args.adapter, args.allow_non_finite))
    merged.save_pretrained(args.output, dtype=DTYPE_ALIASES[args.dtype] if args.dtype else None)
    print(f"wrote {args.output}")


def cmd_preprocess(argv: List[str]) -> None:
    """Tokenize JSON-lines (text, or chat / instruction / prompt-response) and pack into fixed-length rows."""
    p = _parser(cmd_preprocess, "mindqwen preprocess outputs/demo/data/train.jsonl --output out/train --kind sft "
                                "--tokenizer outputs/demo/data/tokenizer.model --seq-length 32 --workers 2")
    p.add_argument("inputs", nargs="+", help=".jsonl files (or .json arrays): {\"text\"} records (--kind text) or {\"messages\"} / "
                                             "{\"instruction\", \"input\", \"output\"} / {\"prompt\", \"response\"} (--kind sft)")
    p.add_argument("--output", required=True, help="folder to create: input_ids.npy, labels.npy, position_ids.npy (text, sft), manifest.json")
    p.add_argument("--tokenizer", required=True, help="Qwen HF folder, qwen.tiktoken, or SentencePiece .model")
    p.add_argument("--kind", default="text", choices=["text", "sft", "preference"],
                   help="preference: chosen / rejected pairs (docs/training.md), rows [pairs, 2, seq_length]")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--template", default="qwen2.5", choices=["qwen2.5", "qwen3", "none"],
                   help="chat template (sft, preference; none: plain text and EOS, preference only)")
    p.add_argument("--train-on", default="assistant", choices=["assistant", "last", "all"], help="loss mask (sft)")
    p.add_argument("--skip-bad", action="store_true", help="skip malformed records (counted) instead of stopping")
    args = p.parse_args(argv)
    from mindqwen.data.preprocess import preprocess
    s = preprocess(args.inputs, args.output, args.tokenizer, args.seq_length, args.kind, args.workers,
                   args.template, args.train_on, args.skip_bad)
    print(f"wrote {args.output}: {s.documents} documents, {s.tokens} tokens, {s.rows} rows of {args.seq_length}, "
          f"padding {s.padding_fraction:.1%}, truncated {s.truncated}, skipped {s.skipped}"
          + (f" (lines {', '.join(map(str, s.skipped_lines))})" if s.skipped else ""))


def cmd_estimate(argv: List[str]) -> None:
    """Memory per device for a recipe (weights, gradients, optimizer, activations) and whether it fits."""
    p = _parser(cmd_estimate, "mindqwen estimate recipes/qwen2_5/7b_lora.yaml --device 910B")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--device", default="910B", help="910B | 910A | 310P | CPU | memory in GB (e.g. 24)")
    args = p.parse_intermixed_args(argv)  # overrides may follow options
    from mindqwen.estimate import estimate_recipe, format_estimate
    from mindqwen.train.recipe import load_recipe
    print(format_estimate(estimate_recipe(load_recipe(args.recipe, args.overrides), args.device)))


def cmd_validate(argv: List[str]) -> None:
    """Load and type-check a recipe, check its files and parallel layout, and build its model."""
    p = _parser(cmd_validate, "mindqwen validate recipes/qwen2_5/7b_lora.yaml --tiny")
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.add_argument("--tiny", action="store_true",
                   help="build a tiny model of the same architecture instead of the real checkpoint")
    args = p.parse_intermixed_args(argv)  # overrides may follow options
    from mindqwen.tasks import validate_recipe
    print(validate_recipe(args.recipe, args.overrides, args.tiny))


def cmd_recipes(argv: List[str]) -> None:
    """List the bundled recipes, or copy one to edit."""
    p = _parser(cmd_recipes, "mindqwen recipes ls\n  mindqwen recipes cp qwen2_5/7b_lora my_recipe.yaml")
    p.add_argument("action", choices=["ls", "cp"])
    p.add_argument("name", nargs="?", help="cp: recipe name as listed by ls")
    p.add_argument("dest", nargs="?", help="cp: destination file")
    args = p.parse_args(argv)
    from mindqwen.train.recipe import bundled_recipes
    recipes = bundled_recipes()
    if args.action == "ls":
        for name, path in recipes.items():
            with open(path, encoding="utf-8") as f:
                print(f"{name:28s} {f.readline().lstrip('# ').strip()}")
        return
    if not args.name or not args.dest:
        raise ValueError("usage: mindqwen recipes cp <name> <dest.yaml>")
    if args.name not in recipes:
        raise ValueError(f"no bundled recipe {args.name!r}; `mindqwen recipes ls` lists them")
    if os.path.exists(args.dest):
        raise ValueError(f"{args.dest} exists; not overwriting it")
    shutil.copyfile(recipes[args.name], args.dest)
    print(f"copied {args.name} to {args.dest}")


def cmd_doctor(argv: List[str]) -> None:
    """Check this install on this device against golden models (numerics, a LoRA step, generation,
    export, parallel runs, experts) and write a report to attach to bug reports."""
    p = _parser(cmd_doctor, "mindqwen doctor --quick --report doctor.json\n"
                            "  mindqwen doctor --device Ascend --report doctor.json")
    p.add_argument("--device", choices=["CPU", "Ascend"],
                   help="default: Ascend where the CANN toolkit's environment is set, else CPU")
    p.add_argument("--quick", action="store_true", help="leave out the multi-process runs (check 5)")
    p.add_argument("--report", help="write the versions, devices and every figure as JSON")
    p.add_argument("--only", help="comma-separated check numbers (1-6)")
    args = p.parse_args(argv)
    from mindqwen import backend
    from mindqwen.doctor import CHECKS, run_doctor
    from mindqwen.io.jsonfile import write_json
    try:
        only = [int(n) for n in args.only.split(",")] if args.only else None
    except ValueError:
        raise ValueError(f"--only takes check numbers like 1,3, got {args.only!r}") from None
    if only and not set(only) <= set(range(1, len(CHECKS) + 1)):
        raise ValueError(f"--only: checks are numbered 1 to {len(CHECKS)}, got {args.only}")
    device = args.device or ("Ascend" if backend.on_ascend() else "CPU")
    report = run_doctor(device, args.quick, only)
    counts = report["summary"]
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    if args.report:
        write_json(args.report, report)
        print(f"report: {args.report} (attach it to a bug report)")
    if counts["FAIL"]:
        raise SystemExit(EXIT_ERROR)


COMMANDS: Dict[str, Callable[[List[str]], None]] = {
    "train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "export": cmd_export, "serve": cmd_serve,
    "convert": cmd_convert, "merge": cmd_merge, "preprocess": cmd_preprocess, "estimate": cmd_estimate,
    "validate": cmd_validate, "recipes": cmd_recipes, "doctor": cmd_doctor,
}


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: mindqwen {" + ",".join(COMMANDS) + "} ...  (--help on each)\n"
              + "\n".join(f"  {name:11s} {fn.__doc__.splitlines()[0]}" for name, fn in COMMANDS.items()))
        return EXIT_OK if not argv or argv[0] in ("-h", "--help") else EXIT_USAGE
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        COMMANDS[argv[0]](argv[1:])
    except Exception as e:
        code = exit_code(e)
        if debug or code is None:
            raise
        text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        if not isinstance(e, MemoryError):  # its lines are the knobs to turn, one a line
            text = " ".join(text.split())
        print(f"mindqwen {argv[0]}: error: {text}", file=sys.stderr)
        return code
    return EXIT_OK


def exit_code(error: Exception) -> Optional[int]:
    """The exit code of a known error, None for an unexpected one (it keeps its traceback)."""
    if isinstance(error, (ValueError, OSError, KeyError, MemoryError)):  # RecipeError, ConfigError,
        return EXIT_ERROR                                                 # CheckpointError are ValueErrors
    if isinstance(error, ImportError) and "pip install" in str(error):  # an extra that is not installed
        return EXIT_ERROR
    loop = sys.modules.get("mindqwen.train.loop")  # loaded if training ran
    if loop is not None and isinstance(error, loop.TrainingDiverged):
        return EXIT_DIVERGED
    return None


if __name__ == "__main__":
    sys.exit(main())
