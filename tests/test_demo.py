"""The README's main command: the demo recipe, end to end, as a user runs it.

It must learn: held-out exact match after LoRA must beat before-LoRA by at least MARGIN (the
pre-trained model has never seen the question format, so "before" is ~0%)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARGIN = 0.5  # absolute exact-match gain on the 120 held-out questions
# ``python -m mindqwen``, with the op threads conftest gives a worker under ``-n 2`` (the other
# worker runs beside it: two op threads here would oversubscribe the two cores).
MAIN = ("import os, runpy, mindqwen, mindspore as ms\n"
        "if os.environ.get('PYTEST_XDIST_WORKER'): ms.device_context.cpu.op_tuning.threads_num(1)\n"
        "runpy.run_module('mindqwen', run_name='__main__', alter_sys=True)")


@pytest.mark.slow
def test_demo_recipe_learns_and_writes_every_output(tmp_path):
    out = tmp_path / "outputs" / "demo"
    r = subprocess.run([sys.executable, "-c", MAIN, "train", os.path.join(ROOT, "recipes", "demo", "demo.yaml"),
                        "trainer.output_dir=outputs/demo", "trainer.progress=false"], cwd=tmp_path,
                       capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"}, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert os.listdir(tmp_path) == ["outputs"]  # compiled kernels and compiler logs live elsewhere
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["exact_match_before"], summary["exact_match_after"]
    assert after >= before + MARGIN, (before, after)
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "export" / "decode.mindir").is_file() and summary["export"]["passed"]
    assert summary["export"]["eager_same_steps"]["max_abs_logit_diff"] <= 1e-5
    assert (out / "pretrain" / "model" / "config.json").is_file() and (out / "data" / "tokenizer.model").is_file()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == summary["train"]["steps"]
    assert len(summary["samples"]) == 4
