"""The package's layers point one way: no import cycle between modules (lazy imports inside
functions count), and the lower layers never import the upper ones."""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mindqwen")
# package (or top-level module) → what it must not import
APPS = {"train", "export", "serve", "tasks", "demos"}  # what composes the layers below it
FORBIDDEN = {
    "io": APPS | {"models", "lora", "multimodal", "generation", "data", "preference", "rl"},
    "data": APPS | {"models", "lora", "multimodal", "generation", "preference", "rl"},
    "config": APPS | {"models", "lora", "multimodal", "generation", "preference", "rl"},
    "models": APPS | {"lora", "multimodal", "generation", "data", "preference", "rl"},
    "lora": APPS | {"multimodal", "generation", "preference", "rl"},
    "rl": APPS | {"preference"},
    "generation": APPS | {"multimodal"},
    "multimodal": APPS,
    "export": APPS - {"export"},
    "serve": APPS - {"serve"} | {"lora"},
    "train": {"tasks", "demos", "serve"},
    "demos": {"train", "tasks", "export", "serve", "generation", "lora"},
}


def _modules():
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: str, modules) -> set:
    """mindqwen modules ``name`` imports anywhere in its file, TYPE_CHECKING blocks excluded."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:  # `from mindqwen.tasks import causal_lm` names a module
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in modules and m != name}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "mindqwen"


def test_no_import_cycle_between_modules():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" → ".join(c) for c in cycles)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_lower_layers_do_not_import_upper_ones(layer):
    graph = _graph()
    wrong = sorted(f"{a} → {b}" for a, targets in graph.items() if _layer(a) == layer
                   for b in targets if _layer(b) in FORBIDDEN[layer])
    assert not wrong, wrong


def test_the_walk_sees_lazy_imports():
    """The walker is not vacuous: it finds an import made inside a function."""
    graph = _graph()
    assert "mindqwen.demos.shapes" in graph["mindqwen.tasks.multimodal"]  # imported lazily for the demo's data
    assert "mindqwen.export.vision" in graph["mindqwen.tasks.multimodal"]
    assert "mindqwen.io.hf" in graph["mindqwen.models.qwen"]
