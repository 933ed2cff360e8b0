"""The package's shape, as docs/architecture.md draws it: layers that import only downwards,
and no import circles (function-local imports included: they are circles all the same)."""

import ast
from pathlib import Path

import ckptlab

ROOT = Path(ckptlab.__file__).parent

# Lower layers never import higher ones; packages on one layer never import each other.
BASE = (
    "ckptlab",
    "ckptlab.dtypes",
    "ckptlab.errors",
    "ckptlab.jsonable",
    "ckptlab.numbers",
    "ckptlab.stats",
)  # the root: version, lazy names
LAYERS = {
    "ckptlab.io": 1,
    "ckptlab.run": 2,
    "ckptlab.analysis": 3,
    "ckptlab.training": 3,
    "ckptlab.trackers": 3,
    "ckptlab.record": 4,
    "ckptlab.replayer": 4,
    "ckptlab.render": 5,
    "ckptlab.integrations": 6,
    "ckptlab.cli": 6,
    "ckptlab.examples": 6,
}
# The one deliberate arrow up: `ckptlab diff RUN@STEP` opens a run's checkpoint through io/.
ALLOWED_UP = {("ckptlab.io.open", "ckptlab.run")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the ckptlab modules it imports, anywhere in its body."""
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import module` imports that module; `from pkg import name`, the package
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in found:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    targets.add(target)
        edges[name] = targets
    return edges


def _layer(module: str) -> tuple[str, int]:
    """(the package a module belongs to, its layer)."""
    if module in BASE:
        return "base", 0
    if module == "ckptlab.__main__":
        return "ckptlab.cli", LAYERS["ckptlab.cli"]
    key = next(k for k in LAYERS if module == k or module.startswith(k + "."))
    return key, LAYERS[key]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles(_imports(_modules())) == []


def test_layers_import_only_downwards():
    wrong = []
    for module, targets in _imports(_modules()).items():
        own, level = _layer(module)
        for target in targets:
            other, target_level = _layer(target)
            if other == own or target_level < level:
                continue
            if not any(module == m and other == t for m, t in ALLOWED_UP):
                wrong.append(f"{module} -> {target}")
    assert sorted(wrong) == []


def test_the_checker_sees_circles_and_arrows_up():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("ckptlab.replayer.blame") == ("ckptlab.replayer", 4)
    assert _layer("ckptlab.run") == ("ckptlab.run", 2)
    assert _layer("ckptlab.stats") == ("base", 0)
