"""Every ``mindqwen`` subcommand: ``--help`` with an example, and one real invocation each,
checked against an independent reference (HF / PEFT golden outputs, SentencePiece, closed forms).
``train`` runs in test_demo.py, ``generate`` in test_generate_cli.py, ``validate`` in test_recipe.py."""
import json
import math
import os
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest

from conftest import fixture_path, reference
from mindqwen import from_pretrained
from mindqwen.cli import COMMANDS
from mindqwen.io.safetensors import SafetensorsFile


def cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "mindqwen", *args], capture_output=True, text=True,
                       env={**os.environ, "GLOG_v": "3"}, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-2000:]
    return r


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help_with_an_example(command):
    r = cli(command, "--help")
    assert f"usage: mindqwen {command}" in r.stdout and "example:" in r.stdout


def test_top_level_usage_lists_every_command():
    r = cli()
    assert all(name in r.stdout for name in COMMANDS)


def test_eval_loss_matches_hf(tmp_path):
    ref = reference("qwen2_tiny")
    np.save(tmp_path / "rows.npy", ref["input_ids"].astype(np.int32))
    r = cli("eval", fixture_path("qwen2_tiny", "base"), "--data", str(tmp_path / "rows.npy"),
            "--seq-length", "16", "--batch-size", "2")
    loss = float(r.stdout.split("loss ")[1].split()[0])
    assert abs(loss - float(ref["loss"])) < 1e-4  # printed to 4 decimals
    ppl = float(r.stdout.split("perplexity ")[1].split()[0])
    assert abs(ppl / math.exp(float(ref["loss"])) - 1) < 1e-4


def test_export_writes_graphs_that_reproduce_hf_logits(tmp_path):
    ref = reference("qwen3_tiny")
    out = tmp_path / "export"
    r = cli("export", fixture_path("qwen3_tiny", "base"), "--output", str(out), "--batch-sizes", "2",
            "--max-seq-len", "32", "--seq-buckets", "16")
    assert "tokens identical = True" in r.stdout and "converter_lite is not on PATH" in r.stdout
    graph = ms.nn.GraphCell(ms.load(str(out / "prefill.mindir")))
    ids = ref["input_ids"].astype(np.int32)
    cache = np.zeros((2, 2, 2, 32, 32), np.float32)  # layers, batch, KV heads, slots, head_dim
    mask = np.zeros((2, 32), np.int32)
    mask[:, :16] = 1
    positions = np.tile(np.arange(16, dtype=np.int32), (2, 1))  # also each row's cache slots
    logits = graph(*map(ms.Tensor, (ids, positions, mask, positions, cache, cache)))[0].asnumpy()
    np.testing.assert_allclose(logits, ref["logits"][:, -1], atol=5e-5)


def test_export_of_a_finished_recipe_run_is_the_trained_lora_model(tmp_path):
    """``mindqwen export <recipe>``: the exported prefill graph gives the logits of the run's base
    checkpoint with its saved PEFT adapter merged in (≤ 5e-5), with the recipe's export settings."""
    from mindqwen import load_adapter, merge_and_unload
    np.save(tmp_path / "train.npy", np.random.default_rng(0).integers(0, 512, (8, 16)).astype(np.int32))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{checkpoint: {fixture_path('qwen2_tiny', 'base')}}}\n"
                      f"data: {{train: {tmp_path / 'train.npy'}, seq_length: 16}}\n"
                      "lora: {r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}\n"
                      f"trainer: {{max_steps: 2, micro_batch_size: 4, lr: 0.01, output_dir: {tmp_path / 'run'}}}\n"
                      "export: {batch_sizes: [1], max_seq_len: 32, seq_buckets: [16], dtype: float32}\n")
    cli("train", str(recipe))
    r = cli("export", str(recipe))
    assert f"wrote {tmp_path / 'run' / 'export'}" in r.stdout
    expected = merge_and_unload(load_adapter(from_pretrained(fixture_path("qwen2_tiny", "base")),
                                             str(tmp_path / "run" / "adapter")))
    base = from_pretrained(fixture_path("qwen2_tiny", "base"))
    ids = np.random.default_rng(1).integers(0, 512, (1, 16)).astype(np.int32)
    want, untrained = (m(ms.Tensor(ids)).asnumpy()[:, -1] for m in (expected, base))
    assert np.abs(want - untrained).max() > 1e-3  # the adapter changed the model
    graph = ms.nn.GraphCell(ms.load(str(tmp_path / "run" / "export" / "prefill.mindir")))
    cache = np.zeros((2, 1, 2, 32, 16), np.float32)  # layers, batch, KV heads, slots, head_dim
    mask = np.zeros((1, 32), np.int32)
    mask[:, :16] = 1
    positions = np.arange(16, dtype=np.int32)[None]  # also the row's cache slots
    logits = graph(*map(ms.Tensor, (ids, positions, mask, positions, cache, cache)))[0].asnumpy()
    np.testing.assert_allclose(logits, want, atol=5e-5)
    with pytest.raises(AssertionError, match="--dtype is for an HF folder"):
        cli("export", str(recipe), "--dtype", "float16")


def test_convert_round_trip_keeps_hf_logits(tmp_path):
    ckpt, back = tmp_path / "model.ckpt", tmp_path / "hf"
    cli("convert", fixture_path("qwen2_tiny", "base"), str(ckpt))
    cli("convert", str(ckpt), str(back), "--config", fixture_path("qwen2_tiny", "base"))
    logits = from_pretrained(str(back))(ms.Tensor(reference("qwen2_tiny")["input_ids"].astype(np.int32))).asnumpy()
    np.testing.assert_allclose(logits, reference("qwen2_tiny")["logits"], atol=5e-5)
    r = cli("convert", str(ckpt), str(tmp_path / "x"), check=False)
    assert r.returncode == 1 and "needs --config" in r.stderr


def test_merge_matches_peft_merged_weights_and_logits(tmp_path):
    out = tmp_path / "merged"
    cli("merge", fixture_path("qwen2_tiny", "base"), fixture_path("qwen2_tiny", "lora_adapter"), str(out))
    ours, peft = SafetensorsFile(str(out / "model.safetensors")), SafetensorsFile(fixture_path("qwen2_tiny", "merged", "model.safetensors"))
    assert set(ours.keys()) == set(peft.keys())
    worst = max(np.abs(ours.get(k) - peft.get(k)).max() for k in peft.keys())
    print(f"merged weights vs PEFT's merge_and_unload: max |Δ| = {worst:.1e}")
    assert worst <= 1e-6
    ref = reference("qwen2_tiny")
    logits = from_pretrained(str(out))(ms.Tensor(ref["input_ids"].astype(np.int32))).asnumpy()
    np.testing.assert_allclose(logits, ref["logits_merged"], atol=5e-5)
    # the same base as a MindSpore .ckpt (any supported format merges)
    cli("convert", fixture_path("qwen2_tiny", "base"), str(tmp_path / "base.ckpt"))
    cli("merge", str(tmp_path / "base.ckpt"), fixture_path("qwen2_tiny", "lora_adapter"), str(tmp_path / "m2"),
        "--config", fixture_path("qwen2_tiny", "base"))
    again = SafetensorsFile(str(tmp_path / "m2" / "model.safetensors"))
    assert all(np.array_equal(again.get(k), ours.get(k)) for k in peft.keys())


def test_preprocess_rows_equal_sentencepiece_encoding(tmp_path):
    import sentencepiece as spm
    from mindqwen.data.tokenizer import train_sentencepiece
    lines = [f"Q: Repeat the letters {a} {b}. A: {a} {b}" for a in "abcdefgh" for b in "ijklmnop"]
    train_sentencepiece(lines, str(tmp_path / "tok.model"), 60)
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps({"prompt": f"Q: Repeat {a}.", "response": f" {a}"})
                                                    for a in "abcd") + "\n")
    r = cli("preprocess", str(tmp_path / "pairs.jsonl"), "--output", str(tmp_path / "rows"), "--kind", "sft",
            "--tokenizer", str(tmp_path / "tok.model"), "--seq-length", "12")
    assert "4 documents" in r.stdout
    ids, labels = np.load(tmp_path / "rows" / "input_ids.npy"), np.load(tmp_path / "rows" / "labels.npy")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok.model"))
    p, resp = sp.encode("Q: Repeat a."), sp.encode(" a") + [sp.eos_id()]
    assert ids[0, :len(p) + len(resp)].tolist() == p + resp  # first conversation at the start of row 0
    assert labels[0, :len(p) + len(resp)].tolist() == [-100] * len(p) + resp
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    bad = cli("preprocess", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "b"), "--kind", "sft",
              "--tokenizer", str(tmp_path / "tok.model"), check=False)
    assert bad.returncode == 1 and "bad.jsonl:1:" in bad.stderr and not (tmp_path / "b").exists()


def test_recipes_ls_and_cp(tmp_path):
    listed = cli("recipes", "ls").stdout
    assert "demo/demo" in listed and "qwen2_5/7b_full_8card_tp2_pp4" in listed
    cli("recipes", "cp", "qwen3/8b_lora", str(tmp_path / "mine.yaml"))
    assert (tmp_path / "mine.yaml").read_text().startswith("# Qwen3-8B LoRA")
    again = cli("recipes", "cp", "qwen3/8b_lora", str(tmp_path / "mine.yaml"), check=False)
    assert again.returncode == 1 and "exists" in again.stderr


def test_validate_a_bundled_recipe():
    r = cli("validate", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "qwen2_5",
                                      "7b_full_8card_tp2_pp4.yaml"), "--tiny")
    assert "ok" in r.stdout and "dp 1 × tp 2 × pp 4 = 8 devices" in r.stdout and "28 layers, hidden 3584" in r.stdout
