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
