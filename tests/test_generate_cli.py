"""Greedy generation against HF's ``generate`` (gen_ids in the golden references), and the CLI."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import MODELS, fixture_path, reference
from mindqwen import from_pretrained
from mindqwen.generation import generate

PROMPT_LEN = 16  # the references continue input_ids[0] (16 tokens) by 8 greedy tokens


@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_equals_hf(name):
    ref = reference(name)
    gen = ref["gen_ids"]
    prompt = ref["input_ids"][:1, :PROMPT_LEN]
    assert np.array_equal(gen[:, :PROMPT_LEN], prompt)
    out = generate(from_pretrained(fixture_path(name, "base")), prompt,
                   max_new_tokens=gen.shape[1] - PROMPT_LEN)
    assert out.dtype == np.int32 and np.array_equal(out, gen)


def test_generation_stops_at_eos():
    ref = reference("qwen2_tiny")
    eos = int(ref["gen_ids"][0, PROMPT_LEN + 3])
    assert eos not in ref["gen_ids"][0, PROMPT_LEN:PROMPT_LEN + 3]
    out = generate(from_pretrained(fixture_path("qwen2_tiny", "base")),
                   ref["input_ids"][:1, :PROMPT_LEN], max_new_tokens=10, eos_token_id=eos)
    assert np.array_equal(out[0], ref["gen_ids"][0, :PROMPT_LEN + 4])


def _cli(*args):
    env = {**os.environ, "GLOG_v": "3"}
    return subprocess.run([sys.executable, "-m", "mindqwen", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_cli_generate_prints_the_continuation():
    ref = reference("qwen3_tiny")
    prompt = ",".join(str(t) for t in ref["input_ids"][0, :PROMPT_LEN])
    r = _cli("generate", fixture_path("qwen3_tiny", "base"), "--input-ids", prompt, "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert f"generated: {ref['gen_ids'][0, PROMPT_LEN:PROMPT_LEN + 4].tolist()}" in r.stdout


def test_cli_bad_checkpoint_is_one_line_error():
    r = _cli("generate", "no/such/dir", "--input-ids", "1,2")
    assert r.returncode == 1
    assert "mindqwen generate: error: no/such/dir: checkpoint folder not found" in r.stderr
    assert "Traceback" not in r.stderr
