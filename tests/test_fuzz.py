"""Property-based fuzzing of the inputs users hand-write: recipes, JSON-lines records, adapter configs.

The one outcome allowed for any input: success, or one ``mindqwen <cmd>: error:`` line and exit
code 1 — never a traceback, a hang or a half-written output. Inputs invalid by construction
(a wrong type, a non-finite number, an unknown or duplicate key, broken syntax, a bad record) must
fail: a success there is a silent failure. Valid records must all be kept.

Fixed seed (``derandomize``) and budget: ~600 cases in under a minute. A longer run by hand:
``MINDQWEN_FUZZ=20 pytest tests/test_fuzz.py`` (20× the examples, a fresh seed each run).
"""
import io
import json
import math
import os
import shutil
import signal
from contextlib import contextmanager, redirect_stderr, redirect_stdout

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import fixture_path
from mindqwen.cli import main
from mindqwen.data.tokenizer import train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCALE = int(os.environ.get("MINDQWEN_FUZZ", "1"))
HANG_SECONDS = 30


def fuzz_settings(examples):
    return settings(max_examples=examples * SCALE, derandomize=SCALE == 1, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@contextmanager
def no_hang(seconds=HANG_SECONDS):
    def hang(*_):
        raise TimeoutError(f"no answer in {seconds} s: a hang")
    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_cli(*argv):
    """(code, stdout, stderr); an exception escaping ``main`` (a traceback) fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with no_hang(), redirect_stdout(out), redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


COUNTS = {"recipes": [], "jsonl": [], "adapters": []}  # (invalid by construction, exit code) per case


def report(name, budget):
    cases = COUNTS[name]
    print(f"{name}: {len(cases)} cases, {sum(m for m, _ in cases)} invalid by construction, "
          f"{sum(c != 0 for _, c in cases)} one-line errors, 0 tracebacks")
    assert len(cases) >= budget * SCALE


def assert_allowed(code, out, err, command, must_fail, names=None):
    lines = [line for line in err.splitlines() if line.startswith(f"mindqwen {command}: error: ")]
    if code == 0:
        assert not must_fail, f"invalid input accepted:\n{out}"
        return None
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    if names:
        assert names in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ recipes
with open(os.path.join(ROOT, "recipes", "demo", "demo.yaml"), encoding="utf-8") as f:
    DEMO = yaml.safe_load(f)


def scalar_paths(node, prefix=()):
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from scalar_paths(value, prefix + (key,))
        else:
            yield prefix + (key,), value


PATHS = sorted(scalar_paths(DEMO), key=str)
SECTIONS = sorted({p[:1] for p, _ in PATHS} | {p[:2] for p, _ in PATHS if len(p) > 2}, key=str)
ANY = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 40, 2 ** 40), st.floats(allow_nan=True),
                st.text(max_size=12), st.lists(st.integers(-3, 40), max_size=3),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def wrong_type(value):
    """A value no typed key of this kind accepts (int for float is a valid widening: excluded)."""
    if isinstance(value, bool):
        return st.sampled_from([3, "yes please", [True], {"a": 1}, 1.5])
    if isinstance(value, (int, float)):
        return st.sampled_from(["many", [1], {"a": 1}, True])
    if isinstance(value, str):
        return st.sampled_from([7, 2.5, [value], {"a": value}, True])
    if isinstance(value, list):
        return st.sampled_from([7, "q_proj", {"a": 1}])
    return st.nothing()


@st.composite
def recipe_case(draw, data_files):
    """(YAML text, must fail) from the demo recipe and one mutation."""
    raw = json.loads(json.dumps(DEMO))
    kind = draw(st.sampled_from(["value", "wrong_type", "non_finite", "unknown_key", "delete", "section",
                                 "duplicate", "syntax", "data_file"]))
    must_fail = kind in ("wrong_type", "non_finite", "unknown_key", "section", "duplicate", "syntax")
    path, old = draw(st.sampled_from(PATHS))
    parent = raw
    for key in path[:-1]:
        parent = parent[key]
    if kind == "value":
        parent[path[-1]] = draw(ANY)
    elif kind == "wrong_type":
        if old is None or isinstance(old, dict):  # optional or free-form: a type error is not certain
            must_fail, parent[path[-1]] = False, draw(ANY)
        else:
            parent[path[-1]] = draw(wrong_type(old))
    elif kind == "non_finite":
        if isinstance(old, float):
            parent[path[-1]] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        else:
            must_fail = False
    elif kind == "unknown_key":
        parent[draw(st.sampled_from(["lrate", "learning_rate", "epochs", "steps", "batch"]))] = draw(ANY)
    elif kind == "delete":
        del parent[path[-1]]
    elif kind == "section":
        section = draw(st.sampled_from(SECTIONS))
        holder = raw
        for key in section[:-1]:
            holder = holder[key]
        holder[section[-1]] = draw(st.sampled_from([3, "on", [1, 2], True]))
    elif kind == "data_file":
        raw["data"]["synthetic"] = None
        raw["data"][draw(st.sampled_from(["train", "eval"]))] = draw(st.sampled_from(sorted(data_files.values())))
        raw["data"]["train"] = raw["data"]["train"] or data_files["good_npy"]
    text = yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)
    if kind == "duplicate":
        text = text.replace("\n  lr: ", "\n  lr: 0.5\n  lr: ", 1)
    elif kind == "syntax":  # a line that no YAML parser accepts, before any line
        broken = draw(st.sampled_from(["[", "  bad indent: [1, 2", "trainer: {lr: }}", "\tlr: 1", "a: b: c"]))
        lines = text.splitlines()
        at = draw(st.integers(0, len(lines)))
        text = "\n".join(lines[:at] + [broken] + lines[at:]) + "\n"
    return text, must_fail


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz_data")
    files = {"good_npy": d / "good.npy", "short_npy": d / "short.npy", "float_npy": d / "float.npy",
             "jsonl": d / "pairs.jsonl", "binary": d / "blob.npy", "folder": d / "folder", "missing": d / "none.npy"}
    np.save(files["good_npy"], np.random.default_rng(0).integers(0, 150, (64, 32)).astype(np.int32))
    np.save(files["short_npy"], np.zeros((64, 8), np.int32))
    np.save(files["float_npy"], np.zeros((64, 32), np.float32))
    files["jsonl"].write_text('{"prompt": "a", "response": "b"}\n')
    files["binary"].write_bytes(os.urandom(256))
    files["folder"].mkdir()
    return {k: str(v) for k, v in files.items()}


def test_fuzzed_recipes_validate_or_fail_in_one_line(tmp_path_factory, data_files):
    @fuzz_settings(300)
    @given(case=st.data())
    def check(case):
        text, must_fail = case.draw(recipe_case(data_files))
        path = tmp_path_factory.mktemp("recipe") / "r.yaml"
        path.write_text(text, encoding="utf-8")
        code, out, err = run_cli("validate", path)
        assert_allowed(code, out, err, "validate", must_fail, names=str(path))
        COUNTS["recipes"].append((must_fail, code))

    check()
    report("recipes", 300)


# ------------------------------------------------------------------ JSON-lines records
@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    lines = [f"word {i} 你好 answer {i % 7} the quick brown fox" for i in range(300)]
    return str(train_sentencepiece(lines, str(tmp_path_factory.mktemp("sp") / "sp.model"), 40).path)


TEXT = st.text(max_size=20)
GOOD_TEXT = {"text": st.fixed_dictionaries({"text": TEXT}),
             "sft": st.one_of(
                 st.fixed_dictionaries({"prompt": TEXT, "response": TEXT}),
                 st.fixed_dictionaries({"instruction": TEXT, "output": TEXT}, optional={"input": TEXT}),
                 st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
                     "role": st.sampled_from(["system", "user", "assistant"]), "content": TEXT}), min_size=1,
                     max_size=3)}))}
NOT_STRING = st.one_of(st.integers(), st.floats(), st.booleans(), st.none(), st.lists(TEXT, max_size=2))


@st.composite
def bad_record(draw, kind):
    """Bytes of one line that is invalid by construction."""
    how = draw(st.sampled_from(["json", "not_object", "wrong_type", "missing", "utf8", "messages"]))
    if how == "json":
        return draw(st.sampled_from([b"{not json", b'{"text": "a"', b"[" * 3000, b"nan nan", b'{"text": "\x00\\"}']))
    if how == "not_object":
        return json.dumps(draw(st.one_of(st.lists(st.integers(), max_size=2), st.integers(), TEXT))).encode()
    if how == "utf8":
        return b'{"text": "caf' + draw(st.sampled_from([b"\xe9", b"\xff\xfe", b"\xc3", b"\x80"])) + b'"}'
    if how == "messages" and kind == "sft":
        return json.dumps({"messages": draw(st.one_of(TEXT, st.lists(NOT_STRING, min_size=1, max_size=2),
                                                      st.just([]), st.just([{"role": "bot", "content": "x"}])))}).encode()
    key = "text" if kind == "text" else draw(st.sampled_from(["prompt", "instruction"]))
    if how == "missing":
        return json.dumps({"txt" if kind == "text" else "question": draw(TEXT)}).encode()
    pair = {"prompt": "response", "instruction": "output"}.get(key)
    record = {key: draw(NOT_STRING)}
    if pair:
        record[pair] = draw(TEXT)
    return json.dumps(record).encode()


def test_fuzzed_jsonl_records_are_kept_skipped_or_named(tmp_path_factory, sp_model):
    fuzz_settings(200)(given(case=st.data())(lambda case: check_jsonl(tmp_path_factory, sp_model, case)))()
    report("jsonl", 2 * 200)  # each case runs with and without --skip-bad


def check_jsonl(tmp_path_factory, sp_model, case):
    kind = case.draw(st.sampled_from(["text", "sft"]))
    lines = case.draw(st.lists(st.one_of(
        st.tuples(st.just(True), GOOD_TEXT[kind].map(lambda r: json.dumps(r, ensure_ascii=False).encode())),
        st.tuples(st.just(False), bad_record(kind))), min_size=1, max_size=6))
    bom = case.draw(st.booleans())
    folder = tmp_path_factory.mktemp("jsonl")
    path = folder / "in.jsonl"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + b"\n".join(line for _, line in lines) + b"\n")
    first_bad = next((n for n, (ok, _) in enumerate(lines, 1) if not ok), None)
    good = sum(ok for ok, _ in lines)
    for skip in (False, True):
        out_dir = folder / f"out_{skip}"
        argv = ["preprocess", path, "--output", out_dir, "--tokenizer", sp_model, "--kind", kind, "--seq-length", "64"]
        code, out, err = run_cli(*argv, *(["--skip-bad"] if skip else []))
        must_fail = (first_bad is not None and not skip) or good == 0
        line = assert_allowed(code, out, err, "preprocess", must_fail)
        if line is not None and first_bad is not None and not skip:
            assert f"in.jsonl:{first_bad}: " in line, line
        if code == 0:
            assert f"skipped {len(lines) - good}" in out and sorted(os.listdir(out_dir)) == [
                "input_ids.npy", "labels.npy", "manifest.json", "position_ids.npy"]
            assert json.loads((out_dir / "manifest.json").read_text())["documents"] == good
        else:
            assert not out_dir.exists()
        assert not [n for n in os.listdir(folder) if n.startswith(".preprocess")]  # nothing half-written
        COUNTS["jsonl"].append((must_fail, code))


# ------------------------------------------------------------------ adapter configs
ADAPTER = fixture_path("qwen2_tiny", "lora_adapter")
with open(os.path.join(ADAPTER, "adapter_config.json"), encoding="utf-8") as f:
    ADAPTER_CONFIG = json.load(f)
VALID_FIELDS = {  # values that must load (the fixture has r=8 on these targets)
    "lora_alpha": st.one_of(st.integers(-1000, 1000), st.floats(-1e6, 1e6)),
    "lora_dropout": st.floats(0.0, 0.999),
    "use_rslora": st.booleans(),
    "init_lora_weights": st.one_of(st.booleans(), st.sampled_from(["gaussian", "pissa", "loftq", "olora"])),
    "base_model_name_or_path": st.one_of(st.none(), TEXT),
    "some_future_peft_field": ANY,
}
INVALID_FIELDS = {  # values that must be refused
    "lora_alpha": st.one_of(TEXT, st.booleans(), st.none(), st.sampled_from([math.nan, math.inf]), st.lists(TEXT)),
    "r": st.one_of(st.integers(-5, 7), st.integers(9, 64), TEXT, st.floats(), st.booleans()),
    "lora_dropout": st.one_of(st.floats(1.0, 1e9), st.floats(-1e9, -1e-9), TEXT, st.booleans()),
    "use_rslora": st.one_of(TEXT, st.integers(2, 9)),
    "use_dora": st.one_of(TEXT, st.integers(2, 9)),
    "target_modules": st.one_of(st.integers(), st.lists(st.integers(), min_size=1), st.just([]), st.just(None)),
    "layers_to_transform": st.one_of(TEXT.filter(bool), st.lists(TEXT, min_size=1), st.integers(-9, -1)),
    "bias": st.sampled_from(["some", "everything", 1]),
    "peft_type": st.sampled_from(["PREFIX_TUNING", "IA3", 7]),
}


def test_fuzzed_adapter_configs_load_or_fail_in_one_line(tmp_path_factory):
    fuzz_settings(100)(given(case=st.data())(lambda case: check_adapter(tmp_path_factory, case)))()
    report("adapters", 100)


def check_adapter(tmp_path_factory, case):
    config = dict(ADAPTER_CONFIG)
    invalid = case.draw(st.booleans())
    fields = INVALID_FIELDS if invalid else VALID_FIELDS
    for key in case.draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)):
        config[key] = case.draw(fields[key])
    text = json.dumps(config)
    if invalid and case.draw(st.booleans()):  # or the file itself is broken
        text = case.draw(st.sampled_from([text[: len(text) // 2], "[1, 2]", "", "\xff", "null"]))
    folder = tmp_path_factory.mktemp("adapter")
    shutil.copytree(ADAPTER, folder / "a")
    (folder / "a" / "adapter_config.json").write_text(text, encoding="utf-8")
    code, out, err = run_cli("merge", fixture_path("qwen2_tiny", "base"), folder / "a", folder / "merged")
    assert_allowed(code, out, err, "merge", invalid, names=str(folder / "a"))
    if code == 0:  # every merged tensor is finite, read by the safetensors library itself
        from safetensors.numpy import load_file
        merged = load_file(str(folder / "merged" / "model.safetensors"))
        assert merged and all(np.isfinite(t).all() for t in merged.values())
    else:
        assert not (folder / "merged").exists()
    COUNTS["adapters"].append((invalid, code))
