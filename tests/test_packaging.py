"""The installed package, as a user gets it from a wheel: recipes ship inside it (mindqwen.recipes)."""
import os
import subprocess
import sys
import sysconfig
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtualenv outside the checkout with the mindqwen wheel installed (no editable
    paths); its dependencies come from this interpreter's site-packages through a .pth line."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", ROOT, "-w", str(tmp / "dist")],
                   check=True, cwd=tmp, timeout=600)
    wheel = next((tmp / "dist").glob("mindqwen-*.whl"))
    venv.create(tmp / "venv", with_pip=False)
    python = tmp / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:  # a path line: its own .pth files are not run
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, cwd=tmp, timeout=600)
    return tmp


def run(installed, *args):
    r = subprocess.run([installed / "venv" / "bin" / args[0], *args[1:]], capture_output=True, text=True, timeout=600,
                       cwd=installed, env={**os.environ, "GLOG_v": "3", "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_wheel_ships_the_recipes_and_validates_one_by_name(installed):
    where = run(installed, "python", "-c", "import mindqwen.train.recipe as r, mindqwen; "
                                           "print(mindqwen.__file__); print(r.recipes_folder())")
    package, recipes = where.split()
    assert package.startswith(str(installed / "venv")) and recipes.startswith(str(installed / "venv"))
    listed = run(installed, "mindqwen", "recipes", "ls")
    bundled = {os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "recipes"))[:-5]
               for d, _, files in os.walk(os.path.join(ROOT, "recipes")) for f in files if f.endswith(".yaml")}
    assert {line.split()[0] for line in listed.splitlines()} == bundled
    assert "ok" in run(installed, "mindqwen", "validate", "qwen2_5/0.5b_lora", "--tiny")
    assert "ok" in run(installed, "mindqwen", "validate", "demo/demo")


def test_the_wheel_ships_the_doctors_golden_models(installed):
    folder = run(installed, "python", "-c", "import mindqwen.doctor as d; print(d.GOLDENS)").strip()
    assert folder.startswith(str(installed / "venv"))

    def files(root):
        return {os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names}
    assert files(folder) == files(os.path.join(ROOT, "mindqwen", "doctor", "goldens"))


def test_top_level_names_are_the_static_imports_ides_see():
    import ast

    import mindqwen
    with open(mindqwen.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    static = {alias.asname or alias.name for node in block.body for alias in node.names}
    assert static == set(mindqwen.__all__)
    assert all(getattr(mindqwen, name).__name__ == name for name in mindqwen.__all__)
