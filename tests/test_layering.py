"""The layering holds: every import of a project module, lazy ones inside functions included,
points down the list of packages (docs/ARCHITECTURE.md), and no modules import each other in
a circle.

Read from the source with ``ast`` (nothing is imported), so an import that only runs on some
path, or only on a GPU, counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import REPO

# Bottom first. A package may import only packages before it in this list (and itself).
LAYERS = ("fp8train", "data", "parallel", "checkpoint", "models", "families", "training")
# Above every layer: the entry points, the tools a user runs and the benchmarks (they may import
# anything below, but not each other: test_tools_and_benchmarks_are_apart).
TOP = ("tools", "benchmarks")
ENTRY_POINTS = ("pretrain_gpt.py", "pretrain_roberta.py", "pretrain_vit.py")


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # ``from package import module`` imports that module too.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def _project_files() -> dict[str, Path]:
    files = {}
    for package in (*LAYERS, *TOP):
        for path in sorted((REPO / package).rglob("*.py")):
            files[_module_name(path)] = path
    return files


FILES = _project_files()


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (only names that are modules of the tree)."""
    graph = {}
    for name, path in FILES.items():
        graph[name] = {module for _, module in _imports(path) if module in FILES} - {name}
    return graph


def test_the_tree_is_what_the_layers_name():
    tops = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    assert tops == set(LAYERS) | set(TOP), "a package to place in LAYERS: " + str(tops)


@pytest.mark.parametrize("package", LAYERS)
def test_imports_point_down(package):
    allowed = set(LAYERS[: LAYERS.index(package) + 1])
    upward = []
    for name, path in FILES.items():
        if name.split(".")[0] != package:
            continue
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in (*LAYERS, *TOP) and top not in allowed:
                upward.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not upward, "\n".join(upward)


def test_entry_points_are_the_top():
    for entry in ENTRY_POINTS:
        for line, module in _imports(REPO / entry):
            assert module.split(".")[0] not in TOP, f"{entry}:{line} imports {module}"


def test_tools_and_benchmarks_are_apart():
    """What a user runs needs no benchmark, and a benchmark measures the layers, not a tool."""
    crossing = []
    for name, path in FILES.items():
        top = name.split(".")[0]
        if top not in TOP:
            continue
        for line, module in _imports(path):
            other = module.split(".")[0]
            if other in TOP and other != top:
                crossing.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not crossing, "\n".join(crossing)


def test_the_planner_sits_above_the_trainer():
    """training/planning/ runs the trainer's own build and step on meta tensors; the rest of
    training/ (and every layer below) never needs it: only tools, benchmarks and the planner
    itself import it."""
    below = []
    for name, path in FILES.items():
        if name.split(".")[0] in TOP or name.startswith("training.planning"):
            continue
        for line, module in _imports(path):
            if module.startswith("training.planning"):
                below.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not below, "\n".join(below)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle():
    circle = _cycle(_graph())
    assert circle is None, " -> ".join(circle or [])


def test_a_circle_and_an_upward_import_are_seen():
    """The checks can fail: a made-up graph with a circle is caught, and so is the upward
    import that models/ once had (``from families.pretrained import ...`` in a function)."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = "def load():\n    from families.pretrained import load_pretrained\n"
    tree_imports = [
        (n.lineno, n.module) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)
    ]
    assert tree_imports == [(2, "families.pretrained")]
    assert LAYERS.index("families") > LAYERS.index("models")
