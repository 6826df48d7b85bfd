"""Bad input, divergence and torn files: each gets one clear line and a non-zero exit, never a
traceback, a silent success or a half-written output (issue 18's cases, one test each)."""
import io
import json
import os
import re
import shutil
from contextlib import redirect_stderr, redirect_stdout

import mindspore as ms
import numpy as np
import pytest

from conftest import fixture_path
from mindqwen import LoraConfig, apply_lora, from_pretrained, load_adapter
from mindqwen.cli import EXIT_DIVERGED, EXIT_ERROR, main
from mindqwen.data.chat import render
from mindqwen.data.loader import TokenDataset
from mindqwen.data.preprocess import load_packed, preprocess
from mindqwen.data.tokenizer import train_sentencepiece
from mindqwen.io.safetensors import CheckpointError, SafetensorsFile, save_file
from mindqwen.train import checkpoint
from mindqwen.train.config import TrainerConfig
from mindqwen.train.loop import TrainingDiverged, divergence, fit
from mindqwen.train.metrics import MetricsLog
from mindqwen.train.optim import WarmupSchedule, make_optimizer
from mindqwen.train.precision import PrecisionConfig, make_loss_scaler
from mindqwen.train.recipe import RecipeError, load_recipe

DATA = np.random.default_rng(0).integers(0, 512, (32, 24))


def run_cli(*argv):
    """(exit code, stdout, stderr) of ``mindqwen argv`` in this process; a traceback fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code, err, expected_code=EXIT_ERROR, *needles):
    lines = [line for line in err.splitlines() if line.startswith("mindqwen ")]
    assert code == expected_code, err
    assert len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def tiny_recipe(tmp_path, text="", **data):
    """A recipe training a 2-layer model on .npy rows; ``text`` appends or overrides sections."""
    ids = tmp_path / "train.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 64, (16, 16)).astype(np.int32))
    path = tmp_path / "recipe.yaml"
    path.write_text(f"""model:
  config: {{hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4,
           num_key_value_heads: 2, vocab_size: 64, max_position_embeddings: 64}}
data:
  train: {data.get("train", ids)}
  seq_length: {data.get("seq_length", 16)}
""" + text)
    return path


def lora_model():
    ms.set_seed(0)
    return apply_lora(from_pretrained(fixture_path("qwen2_tiny", "base")), LoraConfig(r=4, lora_alpha=8))


def poison(model):
    """NaN base weights: every forward is NaN, as from a corrupt checkpoint loaded with --allow-non-finite."""
    p = model.model.layers[0].mlp.down_proj.weight
    p.set_data(ms.Tensor(np.full(p.shape, np.nan, np.float32)))


# ------------------------------------------------------------------ divergence policy
def test_divergence_policy_closed_form():
    fp16, fp32 = PrecisionConfig(level="O2", max_consecutive_overflows=5), PrecisionConfig()
    assert divergence(2.0, True, 1.0, 1.0, 0, 1, False, fp32, False) is None
    assert "without loss scaling" in divergence(float("nan"), False, float("nan"), 1.0, 1, 0, False, fp32, False)
    assert "without loss scaling" in divergence(2.0, False, float("inf"), 1.0, 1, 3, False, fp32, False)
    assert divergence(2.0, False, float("inf"), 1024.0, 4, 3, False, fp16, True) is None  # an fp16 overflow: skip
    assert "scaler's floor" in divergence(2.0, False, float("inf"), 1.0, 1, 3, False, fp16, True)
    assert "5 consecutive steps" in divergence(2.0, False, float("inf"), 8.0, 5, 3, False, fp16, True)
    assert "last step's loss is nan" in divergence(float("nan"), False, float("nan"), 8.0, 1, 3, True, fp16, True)
    assert "no step of this run" in divergence(2.0, False, float("inf"), 8.0, 2, 0, True, fp16, True)
    assert divergence(2.0, False, float("inf"), 8.0, 2, 9, True, fp16, True) is None  # one overflow at the end


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fp16_run_whose_loss_is_always_nan_fails_and_saves_nothing(tmp_path, level):
    model = lora_model()
    poison(model)
    config = TrainerConfig(max_steps=8, micro_batch_size=4, output_dir=str(tmp_path), progress=False,
                           precision=PrecisionConfig(level=level, dtype="float16"))
    with pytest.raises(TrainingDiverged, match=r"step 8: the last step's loss is nan.*last good checkpoint: none"):
        fit(model, TokenDataset(DATA), config)
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "checkpoints").exists()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["overflow"] for r in records] == [True] * 8  # every step is still logged


def test_fp16_overflow_streak_and_scale_floor_stop_the_run(tmp_path):
    model = lora_model()
    poison(model)
    streak = PrecisionConfig(level="O2", max_consecutive_overflows=3)
    with pytest.raises(TrainingDiverged, match=r"step 3: 3 consecutive steps overflowed"):
        fit(model, TokenDataset(DATA), TrainerConfig(max_steps=8, micro_batch_size=4, output_dir=str(tmp_path / "a"),
                                                     progress=False, precision=streak))
    floor = PrecisionConfig(level="O2", loss_scale=4.0)  # 4 → 2 → 1, then an overflow at the floor
    with pytest.raises(TrainingDiverged, match=r"step 3: gradients overflow at loss scale 1"):
        fit(model, TokenDataset(DATA), TrainerConfig(max_steps=8, micro_batch_size=4, output_dir=str(tmp_path / "b"),
                                                     progress=False, precision=floor))


def test_fp32_divergence_names_a_finite_checkpoint_that_resumes(tmp_path):
    def run(max_steps, lr):
        config = TrainerConfig(max_steps=max_steps, micro_batch_size=4, lr=lr, schedule="constant", save_every=1,
                               resume="auto", output_dir=str(tmp_path), progress=False)
        return fit(lora_model(), TokenDataset(DATA), config)

    run(2, 1e-3)
    assert ms.get_context("mode") == ms.PYNATIVE_MODE  # fit compiles in graph mode and gives the caller's back
    # Resumed with lr 1e39 (inf in fp32): step 3's loss is finite, its update makes the LoRA
    # weights inf, and its checkpoint is refused.
    with pytest.raises(TrainingDiverged, match=r"step 3: parameter .* holds NaN or inf; checkpoint not written; "
                                               r"last good checkpoint: .*step_00000002"):
        run(4, 1e39)
    assert [os.path.basename(c) for c in checkpoint.complete_checkpoints(str(tmp_path))] == [
        "step_00000001", "step_00000002"]
    f = SafetensorsFile(str(tmp_path / "checkpoints" / "step_00000002" / "model.safetensors"))
    assert all(np.isfinite(f.get(k)).all() for k in f.keys())
    result = run(4, 1e-3)  # the named checkpoint resumes
    assert np.isfinite(result["final_loss"]) and result["outputs"]["checkpoint"].endswith("step_00000004")


def test_divergence_through_the_cli_is_one_line_exit_3(tmp_path):
    recipe = tiny_recipe(tmp_path, f"trainer: {{max_steps: 3, micro_batch_size: 4, lr: 1.0e+39, "
                                   f"output_dir: {tmp_path / 'out'}, progress: false}}\n")
    code, _, err = run_cli("train", recipe)
    line = assert_one_line_error(code, err, EXIT_DIVERGED, "step 2: loss is nan", "without loss scaling")
    assert "last good checkpoint: none" in line


# ------------------------------------------------------------------ one validation, run first
@pytest.mark.parametrize("override, needle", [
    ("trainer.lr=.nan", "trainer.lr must be a finite number"),
    ("model.dtype=float64", "model.dtype must be one of float32, float16, bfloat16"),
    ("data.seq_length=24", "expected integer token rows [examples, 24]"),
    ("data.seq_length=1000000000", "data.seq_length=1000000000 exceeds the model's 64 positions (max_position_embeddings)"),
    ("trainer.max_steps=1000000000000000000000", "trainer.max_steps=1000000000000000000000 is out of range"),
    ("trainer.micro_batch_size=17", "16 examples, fewer than one global batch"),
    ("model.config.hidden_sise=8", "unknown key model.config.hidden_sise; did you mean model.config.hidden_size?"),
    ("model.config.rms_norm_eps=.inf", "model.config.rms_norm_eps must be a finite number"),
    ("model.config.num_attention_heads=3", "model.config: hidden_size=32 is not divisible by num_attention_heads=3"),
    ("model.config.vocab_size=32", "token ids must be in [0, 32)"),
    ("trainer.resume=/nowhere", "trainer.resume: /nowhere is not a complete mindqwen checkpoint"),
])
def test_validate_and_train_reject_the_same_recipes_before_building(tmp_path, override, needle):
    recipe = tiny_recipe(tmp_path, f"trainer: {{output_dir: {tmp_path / 'out'}}}\n")
    for command in ("validate", "train"):
        code, _, err = run_cli(command, recipe, override)
        assert_one_line_error(code, err, EXIT_ERROR, needle, str(recipe))
    assert not (tmp_path / "out").exists()  # train stopped before writing anything


def test_output_dir_that_is_a_file_and_missing_or_empty_data(tmp_path):
    (tmp_path / "taken").write_text("a file")
    recipe = tiny_recipe(tmp_path)
    for command in ("validate", "train"):
        code, _, err = run_cli(command, recipe, f"trainer.output_dir={tmp_path / 'taken'}")
        assert_one_line_error(code, err, EXIT_ERROR, "trainer.output_dir", "is a file")
        code, _, err = run_cli(command, recipe, "data.train=null")
        assert_one_line_error(code, err, EXIT_ERROR, "data.train is required")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code, _, err = run_cli("train", empty)
    assert_one_line_error(code, err, EXIT_ERROR, "empty.yaml: the recipe is empty")


def test_duplicate_keys_name_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  lr: 1.0e-3\n  max_steps: 4\n  lr: 5.0\n")
    with pytest.raises(RecipeError, match=r"dup\.yaml:4: duplicate key trainer\.lr \(first given on line 2\)"):
        load_recipe(str(path))


# ------------------------------------------------------------------ weights checked at the edge
def nan_copy(src, dst, file, key):
    shutil.copytree(src, dst)
    f = SafetensorsFile(os.path.join(src, file))
    tensors = {k: f.get(k) for k in f.keys()}
    tensors[key] = tensors[key].copy()
    tensors[key].flat[7] = np.nan
    save_file(tensors, os.path.join(dst, file))


def test_nan_weights_are_refused_by_name_unless_allowed(tmp_path):
    base = fixture_path("qwen2_tiny", "base")
    key = "model.layers.1.mlp.up_proj.weight"
    nan_copy(base, tmp_path / "base", "model.safetensors", key)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor {key} has 1 non-finite values"):
        from_pretrained(str(tmp_path / "base"))
    assert np.isnan(from_pretrained(str(tmp_path / "base"), allow_non_finite=True)
                    .model.layers[1].mlp.up_proj.weight.asnumpy()).sum() == 1
    code, _, err = run_cli("convert", tmp_path / "base", tmp_path / "out.ckpt", "--to", "ms-ckpt")
    assert_one_line_error(code, err, EXIT_ERROR, key, "--allow-non-finite")
    assert not (tmp_path / "out.ckpt").exists()
    assert run_cli("convert", tmp_path / "base", tmp_path / "out.ckpt", "--to", "ms-ckpt", "--allow-non-finite")[0] == 0

    adapter = fixture_path("qwen2_tiny", "lora_adapter")
    a_key = SafetensorsFile(os.path.join(adapter, "adapter_model.safetensors")).keys().__iter__().__next__()
    nan_copy(adapter, tmp_path / "adapter", "adapter_model.safetensors", a_key)
    with pytest.raises(CheckpointError, match=f"tensor {a_key} has 1 non-finite"):
        load_adapter(from_pretrained(base), str(tmp_path / "adapter"))
    code, _, err = run_cli("merge", base, tmp_path / "adapter", tmp_path / "merged")
    assert_one_line_error(code, err, EXIT_ERROR, a_key)
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("field, value, needle", [
    ("lora_alpha", "big", "lora_alpha must be a finite number, got 'big'"),
    ("r", 2.5, "r must be a positive integer"),
    ("r", 9, "lora_A tensors have rank 8"),
    ("target_modules", [3], "target_modules must be a regex or a list of module names"),
    ("layers_to_transform", "all", "layers_to_transform must be layer indices"),
    ("use_dora", "yes", "use_dora must be true or false"),
])
def test_bad_adapter_configs_are_one_line_errors(tmp_path, field, value, needle):
    shutil.copytree(fixture_path("qwen2_tiny", "lora_adapter"), tmp_path / "adapter")
    path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_adapter(from_pretrained(fixture_path("qwen2_tiny", "base")), str(tmp_path / "adapter"))
    code, _, err = run_cli("merge", fixture_path("qwen2_tiny", "base"), tmp_path / "adapter", tmp_path / "merged")
    assert_one_line_error(code, err, EXIT_ERROR, str(tmp_path / "adapter"), needle)
    assert not (tmp_path / "merged").exists()


# ------------------------------------------------------------------ preprocess: file:line, skippable
@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A SentencePiece model that knows the chat template's characters."""
    lines = [render([{"role": "user", "content": f"word {i} 你好"}, {"role": "assistant", "content": f"answer {i}"}])[0]
             for i in range(200)]
    return str(train_sentencepiece(lines, str(tmp_path_factory.mktemp("sp") / "sp.model"), 80).path)


def test_chat_and_instruction_records_work_with_a_sentencepiece_tokenizer(tmp_path, sp_model):
    from mindqwen.data.tokenizer import SentencePieceTokenizer
    tok = SentencePieceTokenizer(sp_model)
    records = [{"messages": [{"role": "user", "content": "word 3"}, {"role": "assistant", "content": "answer 7"}]},
               {"instruction": "word 5", "input": "你好", "output": "answer 9"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    code, _, err = run_cli("preprocess", path, "--output", tmp_path / "out", "--tokenizer", sp_model, "--kind", "sft",
                           "--seq-length", "128")
    assert code == 0, err
    data, _ = load_packed(str(tmp_path / "out"))
    trained = data.labels[data.labels != -100]
    # the loss covers exactly the two answers and their <|im_end|>, by SentencePiece's own encoding
    expected = sum(len(tok.encode(f"answer {n}<|im_end|>")) for n in (7, 9))
    assert abs(len(trained) - expected) <= 2  # at most the "▁" a piece boundary adds per answer
    assert tok.decode(trained.tolist()).replace(" ", "") == "answer7<|im_end|>answer9<|im_end|>"


def test_bad_records_are_file_line_errors_and_skippable(tmp_path, sp_model):
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "word 1"}).encode() + b"\n"  # a BOM on line 1: fine
                     + b'{"text": 123}\n'
                     + b'{"text": "caf\xe9 latin-1"}\n'
                     + b'{"messages": "hi"}\n'
                     + b"[" * 100000 + b"\n"
                     + json.dumps({"text": "word 2"}).encode() + b"\n")
    cases = [(2, '"text" must be a string, got int'), (3, "not UTF-8 text (byte 0xe9"),
             (5, "not valid JSON")]
    for n, needle in cases:
        lines = path.read_bytes().split(b"\n")
        good = [lines[0], lines[5]]
        (tmp_path / "one.jsonl").write_bytes(b"\n".join(good[:1] + [lines[n - 1]] + good[1:]) + b"\n")
        code, _, err = run_cli("preprocess", tmp_path / "one.jsonl", "--output", tmp_path / "o", "--tokenizer", sp_model,
                               "--seq-length", "16")
        assert_one_line_error(code, err, EXIT_ERROR, "one.jsonl:2: " + needle)
        assert not (tmp_path / "o").exists()
    code, out, err = run_cli("preprocess", path, "--output", tmp_path / "s", "--tokenizer", sp_model, "--seq-length", "16",
                             "--skip-bad")
    assert code == 0, err
    assert f"skipped 4 (lines {path}:2, {path}:3, {path}:4, {path}:5)" in out  # 4: a text record needs "text"
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"messages": "hi"}\n{"instruction": "word 1", "output": "answer 1"}\n')
    code, _, err = run_cli("preprocess", sft, "--output", tmp_path / "t", "--tokenizer", sp_model, "--kind", "sft",
                           "--seq-length", "64")
    assert_one_line_error(code, err, EXIT_ERROR, "sft.jsonl:1: messages must be a non-empty list")
    code, out, err = run_cli("preprocess", sft, "--output", tmp_path / "t", "--tokenizer", sp_model, "--kind", "sft",
                             "--seq-length", "64", "--skip-bad")
    assert code == 0 and "skipped 1" in out, err


def test_a_binary_file_is_named_and_never_half_written(tmp_path, sp_model):
    path = tmp_path / "blob.jsonl"
    path.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)))
    code, _, err = run_cli("preprocess", path, "--output", tmp_path / "o", "--tokenizer", sp_model)
    assert_one_line_error(code, err, EXIT_ERROR, "blob.jsonl:1: ")
    code, _, err = run_cli("preprocess", path, "--output", tmp_path / "o", "--tokenizer", sp_model, "--skip-bad")
    assert_one_line_error(code, err, EXIT_ERROR, "blob.jsonl: no usable records")
    assert sorted(os.listdir(tmp_path)) == ["blob.jsonl"]


# ------------------------------------------------------------------ torn files on resume
def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    log = MetricsLog(str(tmp_path), resume_step=2)
    assert [r["step"] for r in log.read()] == [1, 2]
    assert "metrics.jsonl:4: dropping an unreadable metrics line" in capsys.readouterr().err
    log.write({"step": 3, "loss": 0.5})
    assert [json.loads(line)["step"] for line in open(path)] == [1, 2, 3]


def test_resume_skips_a_truncated_or_non_finite_newest_checkpoint(tmp_path, capsys):
    model = lora_model()
    opt = make_optimizer(model.trainable_params(), WarmupSchedule("constant", 1e-3, 10))
    scaler = make_loss_scaler(PrecisionConfig())
    for step in (1, 2, 3):
        for p in model.trainable_params():
            p.set_data(ms.Tensor(np.full(p.shape, step, np.float32)))
        checkpoint.save(str(tmp_path), step, model, opt, scaler, {"step": step})
    newest = tmp_path / "checkpoints" / "step_00000003" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated after the rename (a full disk, a bad copy)
    second = tmp_path / "checkpoints" / "step_00000002" / "model.safetensors"
    f = SafetensorsFile(str(second))
    save_file({k: np.full(f.shape(k), np.inf, np.float32) for k in f.keys()}, str(second))
    for p in model.trainable_params():
        p.set_data(ms.Tensor(np.zeros(p.shape, np.float32)))
    path, state = checkpoint.resume("auto", str(tmp_path), model, opt, scaler)
    assert path.endswith("step_00000001") and state["step"] == 1
    assert all((p.asnumpy() == 1).all() for p in model.trainable_params())
    err = capsys.readouterr().err
    assert "skipping step_00000003: " in err and "truncated file" in err
    assert "skipping step_00000002: " in err and "non-finite values" in err
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000001")
    with pytest.raises(CheckpointError, match="no checkpoint loads"):
        checkpoint.resume("auto", str(tmp_path), model, opt, scaler)


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    from mindqwen.io.atomic import atomic_file
    path = tmp_path / "summary.json"
    path.write_text("old")
    with pytest.raises(ZeroDivisionError):
        with atomic_file(str(path)) as tmp, open(tmp, "w") as f:
            f.write("half a new fi")
            1 / 0
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]
    with atomic_file(str(path)) as tmp, open(tmp, "w") as f:
        f.write("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["summary.json"]
