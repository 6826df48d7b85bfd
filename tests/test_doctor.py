"""``mindqwen doctor`` on the CPU: every check the CPU can run runs and passes (``--quick`` leaves
out the two-process data-parallel run, which runs on its own below), the Ascend-only parts say
why they are skipped, the report holds the figures, and a check can fail."""
import json
import os
import shutil
import subprocess
import sys

import mindspore as ms
import numpy as np
import pytest

from mindqwen import doctor


def run(*args, tmp_path):
    report = tmp_path / "doctor.json"
    r = subprocess.run([sys.executable, "-m", "mindqwen", "doctor", *args, "--report", str(report)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "GLOG_v": "3"})
    return r, (json.loads(report.read_text()) if report.exists() else None)


def test_quick_doctor_passes_every_check_the_cpu_runs(tmp_path):
    r, report = run("--quick", tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = {c["number"]: c["status"] for c in report["checks"]}
    assert status == {1: "PASS", 2: "PASS", 3: "PASS", 4: "PASS", 5: "SKIP", 6: "PASS"}, r.stdout
    checks = {c["number"]: c for c in report["checks"]}
    assert "--quick" in checks[5]["reason"]
    assert checks[1]["figures"]["dense_max_abs"] <= doctor.LOGIT_TOL
    assert checks[1]["figures"]["qwen1_20_max_abs"] <= doctor.LOGIT_TOL
    assert checks[1]["figures"]["dense_float16_max_rel"] <= doctor.LOW_TOL["float16"]
    step = checks[2]["figures"]
    assert step["worst_grad_rel"] <= doctor.GRAD_RTOL and step["compile_and_step_s"] > 0 and step["layers_compiled_once"]
    assert checks[1]["figures"]["qwen3_5_max_rel"] <= doctor.HYBRID_RTOL
    assert checks[3]["figures"]["dense_equals_golden"] and checks[3]["figures"]["moe_equals_full_recompute"]
    assert checks[3]["figures"]["qwen3_5_equals_golden"] and checks[3]["figures"]["qwen3_5_equals_full_recompute"]
    assert checks[4]["figures"]["dense_tokens_identical"] and checks[4]["figures"]["qwen3_5_tokens_identical"]
    assert "converter_lite" in checks[4]["reason"]
    env = report["environment"]
    assert env["versions"]["mindspore"] == ms.__version__ and env["device"] == "CPU" and env["devices"]["count"] >= 1
    assert report["summary"] == {"PASS": 5, "FAIL": 0, "SKIP": 1}
    assert "1. logits of the golden models" in r.stdout and "PASS" in r.stdout


@pytest.mark.slow
def test_data_parallel_check_matches_one_device(tmp_path):
    r, report = run("--only", "5", tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check = report["checks"][0]
    assert check["number"] == 5 and check["status"] == "PASS", check
    assert check["figures"]["dp_max_param_diff"] <= 1e-5 and check["figures"]["dp_max_loss_diff"] <= 1e-5
    assert "need Ascend" in check["reason"]


def test_a_wrong_golden_fails_the_check_and_the_exit_status(tmp_path, monkeypatch):
    goldens = tmp_path / "goldens"
    shutil.copytree(doctor.GOLDENS, goldens)
    with np.load(goldens / "moe" / "golden.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["logits"] = arrays["logits"] + 1e-3  # a kernel that is off by this much
    np.savez(goldens / "moe" / "golden.npz", **arrays)
    monkeypatch.setattr(doctor, "GOLDENS", str(goldens))
    report = doctor.run_doctor("CPU", quick=True, only=[1, 6], echo=lambda line: None)
    assert [c["status"] for c in report["checks"]] == ["FAIL", "FAIL"]
    assert "moe_max_abs" in report["checks"][0]["reason"] and "device_vs_golden" in report["checks"][1]["reason"]
    monkeypatch.undo()
    from mindqwen.cli import main
    monkeypatch.setattr(doctor, "GOLDENS", str(goldens))
    with pytest.raises(SystemExit) as exit_status:
        main(["doctor", "--quick", "--only", "6"])
    assert exit_status.value.code == 1


def test_a_nan_is_a_failure_not_a_pass(tmp_path, monkeypatch):
    goldens = tmp_path / "goldens"
    shutil.copytree(doctor.GOLDENS, goldens)
    with np.load(goldens / "moe" / "golden.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["logits"] = np.full_like(arrays["logits"], np.nan)  # what a broken kernel's output compares like
    np.savez(goldens / "moe" / "golden.npz", **arrays)
    monkeypatch.setattr(doctor, "GOLDENS", str(goldens))
    report = doctor.run_doctor("CPU", quick=True, only=[6], echo=lambda line: None)
    assert report["checks"][0]["status"] == "FAIL" and "device_vs_golden" in report["checks"][0]["reason"]
