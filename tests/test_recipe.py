"""Strict recipe loading: every problem is one line naming the file, the line or override, and the key."""
import textwrap

import pytest

from mindqwen.train.recipe import RecipeError, load_recipe

RECIPE = textwrap.dedent("""\
    model:
      preset: qwen2.5-0.5b
      config: {num_hidden_layers: 2}
    lora:
      r: 8
      target_modules: [q_proj, v_proj]
    trainer:
      max_steps: 10
      lr: 1e-4
      precision: {level: O0}
    """)


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    return str(path)


def test_loads_with_types_and_overrides(recipe_file):
    r = load_recipe(recipe_file, ["trainer.lr=2e-4", "lora.target_modules=[q_proj,k_proj]", "lora.use_dora=true"])
    assert r.trainer.lr == 2e-4 and isinstance(r.trainer.lr, float)  # 1e-4 is a str to YAML 1.1
    assert r.lora.target_modules == ["q_proj", "k_proj"] and r.lora.use_dora is True
    assert r.model.config == {"num_hidden_layers": 2} and r.trainer.precision.level == "O0"
    assert load_recipe(recipe_file, ["lora=null"]).lora is None  # full fine-tune


@pytest.mark.parametrize("text_change,overrides,match", [
    (("  max_steps: 10", "  max_step: 10"), [], r"r\.yaml:8: unknown key trainer\.max_step; did you mean trainer\.max_steps\?"),
    (None, ["trainer.lrr=1"], r"r\.yaml \(override\): unknown key trainer\.lrr; did you mean trainer\.lr\?"),
    (None, ["trainer.max_steps=abc"], r"trainer\.max_steps must be int, got str 'abc'"),
    (("  r: 8", "  r: 1.5"), [], r"r\.yaml:5: lora\.r must be int, got float 1\.5"),
    (None, ["trainer.precision.level=O5"], r"precision\.level must be one of O0, O1, O2, O3, got 'O5'"),
    (("  target_modules: [q_proj, v_proj]", "  target_modules: 7"), [], r"lora\.target_modules must be"),
    (None, ["serve.batch_timeout_ms=100"], r"serve\.batch_timeout_ms was removed: serving uses continuous batching"),
    (None, ["data.synthetic.word_lengths=[5,3]"], r"data\.synthetic\.word_lengths must be \[min, max\]"),
])
def test_bad_recipes_name_file_line_and_key(recipe_file, text_change, overrides, match):
    if text_change:
        with open(recipe_file) as f:
            text = f.read().replace(*text_change)
        with open(recipe_file, "w") as f:
            f.write(text)
    with pytest.raises(RecipeError, match=match):
        load_recipe(recipe_file, overrides)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="nope.yaml: recipe file not found"):
        load_recipe(str(tmp_path / "nope.yaml"))
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match=r"bad\.yaml: not valid YAML"):
        load_recipe(str(tmp_path / "bad.yaml"))


# ---------------------------------------------------------------- bundled recipes and validate
import dataclasses  # noqa: E402
import glob  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from conftest import fixture_path  # noqa: E402
from mindqwen.train import recipe as recipe_module  # noqa: E402
from mindqwen.tasks import validate_recipe  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = sorted(glob.glob(os.path.join(ROOT, "recipes", "**", "*.yaml"), recursive=True))


def test_there_are_bundled_recipes():
    assert len(BUNDLED) >= 10  # demo + 7 Qwen2.5 + 2 Qwen3


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_bundled_recipe_validates_and_builds_tiny(path):
    report = validate_recipe(path, tiny=True)
    assert report.startswith(f"{path}: ok")
    with open(path, encoding="utf-8") as f:
        header = f.read().split("\n\n")[0]
    assert "Launch:" in header and "Override:" in header  # what it is, how to run it, an override


def test_every_recipe_key_is_documented():
    with open(os.path.join(ROOT, "docs", "recipes.md"), encoding="utf-8") as f:
        doc = f.read()
    with open(os.path.join(ROOT, "recipes", "demo", "demo.yaml"), encoding="utf-8") as f:
        demo = f.read()  # the reference recipe lists and comments every key
    with open(os.path.join(ROOT, "recipes", "multimodal", "shapes.yaml"), encoding="utf-8") as f:
        shapes = f.read()  # the multimodal sections' reference recipe
    with open(os.path.join(ROOT, "recipes", "demo", "preference.yaml"), encoding="utf-8") as f:
        preference = f.read()  # the preference section's reference recipe
    multimodal = recipe_module.sections(recipe_module.MultimodalSection)
    for cls in recipe_module.sections()[1:]:
        reference, name = ((shapes, "multimodal/shapes") if cls in multimodal else
                           (preference, "demo/preference") if cls is recipe_module.PreferenceConfig else (demo, "demo/demo"))
        for field in dataclasses.fields(cls):
            if field.init:
                assert f"`{field.name}`" in doc, f"{cls.__name__}.{field.name} is not in docs/recipes.md"
                assert f" {field.name}:" in reference or f"{{{field.name}:" in reference, \
                    f"{cls.__name__}.{field.name} is not in recipes/{name}.yaml"


VALID = textwrap.dedent("""\
    model: {checkpoint: CKPT}
    data: {train: TRAIN, seq_length: 16}
    lora: {r: 4, target_modules: [q_proj, v_proj]}
    trainer: {max_steps: 2}
    """)


@pytest.fixture
def real_recipe(tmp_path):
    import numpy as np
    np.save(tmp_path / "train.npy", np.zeros((4, 16), np.int32))
    path = tmp_path / "real.yaml"
    path.write_text(VALID.replace("CKPT", fixture_path("qwen2_tiny", "base")).replace("TRAIN", str(tmp_path / "train.npy")))
    return str(path)


def test_validate_builds_a_real_checkpoint_recipe(real_recipe):
    assert "ok" in validate_recipe(real_recipe)


@pytest.mark.parametrize("overrides,match", [
    (["data.train=null"], r"real\.yaml: data\.train is required"),
    (["model.checkpoint=/no/such/folder"], r"real\.yaml: model\.checkpoint: /no/such/folder is not an HF folder"),
    (["data.train=/no/such.npy"], r"real\.yaml: data\.train: /no/such\.npy not found"),
    (["parallel.tensor_parallel=3", "parallel.data_parallel=1"],
     r"real\.yaml: parallel: tensor_parallel=3 must divide num_attention_heads=4"),
    (["parallel.pipeline_parallel=2", "parallel.pipeline_micro_batches=2"], r"real\.yaml: parallel: tie_word_embeddings"),
    (["lora.target_modules=[qq_proj]"], r"real\.yaml: lora\.target_modules: .*matches no module"),
    (["trainer.max_steps=two"], r"real\.yaml \(override\): trainer\.max_steps must be int"),
])
def test_validate_errors_name_file_and_key(real_recipe, overrides, match):
    with pytest.raises(RecipeError, match=match):
        validate_recipe(real_recipe, overrides)


@pytest.mark.parametrize("recipe", ["demo/demo.yaml", "multimodal/shapes.yaml"])
def test_validate_runs_the_exports_checks(recipe):
    """The export that runs after training fails in validate, not after the training (both
    recipes' models have max_position_embeddings 64)."""
    path = os.path.join(ROOT, "recipes", recipe)
    with pytest.raises(RecipeError, match=r"export: max_seq_len must be in 2\.\.64 \(max_position_embeddings\), got 80"):
        validate_recipe(path, ["export.enabled=true", "export.max_seq_len=80", "export.seq_buckets=[48]"], tiny=True)
    with pytest.raises(RecipeError, match=r"export: seq_buckets must lie in 1\.\.max_seq_len \(64\)"):
        validate_recipe(path, ["export.enabled=true", "export.max_seq_len=64", "export.seq_buckets=[96]"], tiny=True)


def test_validate_cli_prints_one_line_errors(real_recipe):
    r = subprocess.run([sys.executable, "-m", "mindqwen", "validate", real_recipe, "lora.target_modules=[qq_proj]"],
                       capture_output=True, text=True, env={**os.environ, "GLOG_v": "3"})
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "lora.target_modules" in r.stderr


def test_model_config_overrides_a_checkpoints_config_and_names_an_unknown_field():
    """model.config applies over model.checkpoint's config.json too (it was ignored there)."""
    from mindqwen.config import ConfigError
    from mindqwen.train.model import build_model, model_config
    from mindqwen.train.recipe import ModelSection
    folder = fixture_path("qwen3_moe_tiny", "base")
    section = ModelSection(checkpoint=folder, config={"moe_capacity_factor": 1.25})
    assert model_config(section).moe_capacity_factor == 1.25
    assert build_model(section).model.layers[0].mlp.capacity_factor == 1.25
    with pytest.raises(ConfigError, match=r"unknown QwenConfig field\(s\) \['hiden_size'\]"):
        model_config(ModelSection(checkpoint=folder, config={"hiden_size": 8}))
