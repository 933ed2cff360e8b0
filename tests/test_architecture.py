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
    "ckptlab.stdio",
)  # the root: version, lazy names
BASE_PACKAGES = ("ckptlab.stats",)  # base layer, submodules included
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
    if module in BASE or any(module == p or module.startswith(p + ".") for p in BASE_PACKAGES):
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
    assert _layer("ckptlab.stats.pair") == ("base", 0)


# --- one discipline for files -------------------------------------------------------------------
# Files are read through ckptlab/io/files.py (a regular file, or one clear error: a FIFO would
# hang a reader, a device feed it forever) and written through ckptlab/run/atomic.py (temp file,
# fsync, rename, fsync the folder). Nothing else opens, reads or writes a file by itself, and
# nothing else renames one.
FILE_MODULES = {"ckptlab/io/files.py", "ckptlab/run/atomic.py"}
FILE_CALLS = {"open", "io.open", "os.open", ".open", ".read_bytes", ".read_text", ".write_bytes", ".write_text"}
RENAME_CALLS = {"os.replace", "os.rename", ".rename", "shutil.move"}
# (module, call) -> why it opens a file itself.
FILE_EXCEPTIONS = {
    ("ckptlab/run/lock.py", "os.open"): "the run lock's own file: O_CREAT|O_EXCL to take it, O_NOFOLLOW to read it",
    ("ckptlab/run/checkpoint.py", "os.open"): "big checkpoint files written around the page cache (O_DIRECT)",
    ("ckptlab/run/framelog.py", "os.open"): "journal and batch segments: append-only (O_APPEND), fsynced when closed",
    ("ckptlab/training/userfns.py", ".read_bytes"): "the user's own step_fn/build_fn source, copied into the run",
    ("ckptlab/replayer/distributed.py", ".read_text"): "replay ranks' results, in a private temp folder",
    ("ckptlab/replayer/distributed.py", ".write_text"): "replay ranks' results, in a private temp folder",
}


def _file_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of each call that opens, reads, writes or renames a file by itself: `open`,
    `os.open`, `io.open`, `x.open`, `x.read_bytes/read_text/write_bytes/write_text`,
    `os.replace`, `os.rename`, `x.rename`, `shutil.move`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            found.append((node.lineno, "open"))
        elif isinstance(f, ast.Attribute):
            owner = f.value.id if isinstance(f.value, ast.Name) else ""
            call = f"{owner}.{f.attr}" if owner in ("os", "io", "shutil") else f".{f.attr}"
            if call in FILE_CALLS | RENAME_CALLS:
                found.append((node.lineno, call))
    return found


def _file_offences(sources: dict[str, str]) -> list[str]:
    """`module:line call` for each file call outside FILE_MODULES that FILE_EXCEPTIONS does not
    name, and each rename outside run/atomic.py."""
    out = []
    for module, source in sorted(sources.items()):
        for line, call in _file_calls(source):
            if call in RENAME_CALLS and module != "ckptlab/run/atomic.py":
                out.append(f"{module}:{line} {call}")
            elif call in FILE_CALLS and module not in FILE_MODULES and (module, call) not in FILE_EXCEPTIONS:
                out.append(f"{module}:{line} {call}")
    return out


def _sources() -> dict[str, str]:
    return {path.relative_to(ROOT.parent).as_posix(): path.read_text() for path in ROOT.rglob("*.py")}


def test_files_are_opened_only_by_the_reader_and_the_atomic_writer():
    offences = [o for o in _file_offences(_sources()) if o.split()[1] in FILE_CALLS]
    assert not offences, "open, read or write files through ckptlab/io/files.py or ckptlab/run/atomic.py"


def test_only_the_atomic_writer_renames():
    offences = [o for o in _file_offences(_sources()) if o.split()[1] in RENAME_CALLS]
    assert not offences, "rename through ckptlab/run/atomic.py (rename_durably, atomic_file)"


def test_every_file_exception_is_still_needed():
    sources = _sources()
    used = {(module, call) for module, source in sources.items() for _, call in _file_calls(source)}
    assert set(FILE_EXCEPTIONS) <= used, set(FILE_EXCEPTIONS) - used


def test_the_file_checker_sees_opens_reads_and_renames():
    source = (
        "import os, io, shutil\n"
        "open('a')\nio.open('a')\nos.open('a', 0)\np.open()\np.read_bytes()\np.read_text()\n"
        "p.write_bytes(b'')\np.write_text('')\nos.replace('a', 'b')\nos.rename('a', 'b')\np.rename('b')\n"
        "shutil.move('a', 'b')\ns.replace('a', 'b')\nos.path.join('a')\nread_text('a')\n"
    )
    assert [call for _, call in _file_calls(source)] == [
        "open", "io.open", "os.open", ".open", ".read_bytes", ".read_text", ".write_bytes", ".write_text",
        "os.replace", "os.rename", ".rename", "shutil.move",
    ]  # fmt: skip
    assert _file_offences({"ckptlab/render/x.py": "open('a')", "ckptlab/run/atomic.py": "os.rename('a', 'b')"}) == [
        "ckptlab/render/x.py:1 open"
    ]
    assert _file_offences({"ckptlab/io/files.py": "os.rename('a', 'b')"}) == ["ckptlab/io/files.py:1 os.rename"]
    assert _file_offences({"ckptlab/run/lock.py": "os.open('a', 0)\nopen('a')"}) == ["ckptlab/run/lock.py:2 open"]


# --- sizes a newcomer can read in one sitting ----------------------------------------------------
MAX_LINES = {"module": 600, "class": 300, "function": 60}


def _oversized(module: str, source: str) -> list[str]:
    """`module: kind name lines` for each unit over MAX_LINES (ast spans, docstrings included)."""
    out = []
    if source.count("\n") > MAX_LINES["module"]:
        out.append(f"{module}: module {source.count(chr(10))}")
    for node in ast.walk(ast.parse(source)):
        kind = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}.get(type(node))
        if kind is None:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_LINES[kind]:
            out.append(f"{module}: {kind} {node.name} {lines}")
    return out


def test_modules_classes_and_functions_stay_within_the_house_sizes():
    assert [o for module, source in sorted(_sources().items()) for o in _oversized(module, source)] == []


def test_the_size_checker_sees_a_long_function():
    long_function = "def f():\n" + "    x = 1\n" * 60
    assert _oversized("m.py", long_function) == ["m.py: function f 61"]
    assert _oversized("m.py", "def f():\n" + "    x = 1\n" * 59) == []
