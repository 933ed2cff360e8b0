"""The user's `build_fn` and `step_fn`: recorded by name and hash, imported again for replay.

Recording stores module, qualname, the defining file (absolute, and relative to the run
directory so a moved project still resolves), the file's sha256 and a copy of it under
`sources/`. Replay imports the module by name, or, for a script run as `__main__`, loads the
script file under another module name (so its `if __name__ == "__main__":` block does not
run) -- only when that file is the user's own, unchanged since recording, or with an explicit
opt-in (`trusted_file`). Nothing else from a run directory is ever executed, and the `sources/`
copy is for reading, never imported without the opt-in; see README's Safety section.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

from ckptlab.errors import RecordError, ReplayError, UntrustedCodeError
from ckptlab.run.atomic import write_bytes_atomic
from ckptlab.run.hashing import sha256_file
from ckptlab.run.layout import sources_dir
from ckptlab.run.manifest import recorded_code

# Which recorded code replay runs is said at WARNING: a user with no logging set up sees it.
log = logging.getLogger(__name__)


def describe(fn: Callable, role: str, run_dir: Path) -> dict:
    """What replay needs to find `fn` again; raises RecordError if it could not."""
    if not callable(fn):
        raise RecordError(f"{role} must be a function, got {type(fn).__name__}")
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise RecordError(
            f"{role} {qualname or fn!r} must be a module-level function: replay imports it by name "
            "(define it with `def` at the top level of your module or script)"
        )
    mod = sys.modules.get(module)
    if _resolve(mod, qualname) is not fn:
        raise RecordError(f"{role} {module}.{qualname} cannot be found again by its name")
    # Through decorators to the user's own def: a torch.compile'd step_fn's wrapper is defined in
    # torch, but the code that runs, and is hashed, is the user's file.
    file = inspect.getsourcefile(inspect.unwrap(fn)) or getattr(mod, "__file__", None)
    desc = {"module": module, "qualname": qualname, "file": None, "file_rel": None, "sha256": None}
    if file and os.path.isfile(file):
        path = Path(file).resolve()
        data = path.read_bytes()
        desc.update(
            file=str(path),
            file_rel=os.path.relpath(path, run_dir.resolve()),
            sha256=hashlib.sha256(data).hexdigest(),
            cwd=os.getcwd(),
        )
        src = sources_dir(run_dir)
        src.mkdir(parents=True, exist_ok=True)
        copy = src / f"{desc['sha256']}{path.suffix}"
        if not copy.exists() or hashlib.sha256(copy.read_bytes()).hexdigest() != desc["sha256"]:
            write_bytes_atomic(copy, data)  # a kill mid-copy must not leave a truncated "record"
        desc["source_copy"] = os.path.relpath(copy, run_dir)
        if module == "__main__":
            _warn_unguarded(path, data)
    return desc


def _resolve(obj, qualname: str):
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


# What a training loop calls, by the name of the function or method: loss.backward(),
# fabric.backward(loss), optimizer.step(), rec.step(batch), trainer.fit(model), trainer.train().
TRAINING_CALLS = frozenset({"backward", "step", "fit", "train"})


def _warn_unguarded(path: Path, source: bytes) -> None:
    """Replay imports the script; a training loop at its top level would start training.

    Warns for the first top-level `for`, `while` or `with` whose body calls, at any depth, a
    function or method named backward, step, fit or train (TRAINING_CALLS), or one the script
    itself defines that does (train_one_epoch() calling loss.backward()). A loop over sys.path
    or a `with open(...)` that reads a config trains nothing, and is left alone."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    trains = _training_functions(tree)
    for node in tree.body:
        if isinstance(node, (ast.For, ast.While, ast.With, ast.AsyncFor, ast.AsyncWith)):
            call = _training_call([*node.body, *getattr(node, "orelse", [])], trains)
            if call is None:
                continue
            what = "`with` block" if isinstance(node, (ast.With, ast.AsyncWith)) else "loop"
            warnings.warn(
                f"{path.name}:{node.lineno}: top-level {what} that trains (it calls {call}()); replay "
                'imports this script, so put the training loop under `if __name__ == "__main__":`',
                stacklevel=4,
            )
            return


def _training_functions(tree: ast.Module) -> set[str]:
    """The names of the functions and methods the script defines that train: that call a
    TRAINING_CALLS name or, in turn, one of them."""
    defs = [d for d in ast.walk(tree) if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef))]
    trains: set[str] = set()
    while True:
        more = {d.name for d in defs if d.name not in trains and _training_call(d.body, trains) is not None}
        if not more:
            return trains
        trains |= more


def _training_call(body: list[ast.stmt], trains: set[str]) -> str | None:
    """The first call in `body` (at any depth) of a training function, as written
    (`rec.step`, `.backward` on an expression, `train_one_epoch`); None when there is none."""
    for stmt in body:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in TRAINING_CALLS or name in trains:
                if isinstance(func, ast.Attribute):
                    owner = func.value.id if isinstance(func.value, ast.Name) else ""
                    return f"{owner}.{name}"
                return name
    return None


_loaded_scripts: dict[Path, object] = {}
_announced: set[tuple] = set()

# The opt-in for running code that is not the user's own, unchanged (see `trusted_file`).
TRUST_FLAG = "--trust-run-code"
TRUST_ENV = "CKPTLAB_TRUST_RUN_CODE"


def trust_from_env() -> bool:
    return os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def trusted_file(desc: dict, role: str, run_dir: Path, *, trust: bool = False) -> tuple[Path | None, bool]:
    """(the file whose code `load` runs for `role`, whether it is unchanged since recording).

    The trust rule: code runs when it is the user's own and unchanged -- the recorded file,
    at its recorded absolute path, outside the run directory, with the recorded sha256, or
    with the recorded code: a file that changed only in comments, blank lines or formatting
    (the same Python tokens as the run's copy of the recorded file) runs too, and the log says
    so. Anything else runs only with the opt-in: `trust=True` (the CLI's --trust-run-code) or
    CKPTLAB_TRUST_RUN_CODE=1; then the file is the one found (also at the same place in the
    current project, or relative to the run directory: a moved project), else the run's copy
    of it (None for a module importable by name). A file found only by those relative paths
    is not trusted on its own: the manifest that names it, and its hash, may come with a run
    someone sent, and so may the file next to it. A run directory is data; this keeps it, and
    what came with it, from being code. Which file that is, `ckptlab info` says too: both ask
    run/manifest.py's `recorded_code`.
    """
    code = recorded_code(desc, run_dir)
    if code.installed:  # ckptlab's own code (integrations, examples): the installed version
        return code.path, True
    path, sha, recorded = code.path, desc.get("sha256"), desc.get("file")
    at_recorded = path is not None and isinstance(recorded, str) and path == Path(recorded).resolve()
    if path is not None and at_recorded and (code.changed is False or code.same_tokens):
        return path, True  # (`load` says which, `layout_only`)
    same = code.changed is False
    if trust or trust_from_env():
        return path or _copy_in_run(desc, run_dir), same
    name = f"{role} ({desc.get('module')}.{desc.get('qualname')})"
    if path is None:
        why = f"the file that defined {name}, {desc.get('file')}, is not on this machine"
    elif same:
        why = (
            f"{name} was recorded in {recorded}; the file with its hash at {path} (a moved project, "
            "or a file that came with the run) is not known to be yours"
        )
    elif not sha:
        why = f"{name} was recorded without a file hash, so {path} cannot be checked"
    else:
        how = (
            "its code, not only comments or formatting"
            if code.compared
            else "its sha256 differs; the run holds no copy of the recorded file to compare its code with"
        )
        why = f"{path}, which defines {name}, changed since recording ({how})"
    raise UntrustedCodeError(
        f"{why}; ckptlab runs only your own code, unchanged since recording",
        path=run_dir,
        hint=f"if you trust this run's code, pass {TRUST_FLAG} or set {TRUST_ENV}=1",
    )


def layout_only(desc: dict, run_dir: Path) -> bool:
    """The user's file differs from the recorded one only in comments, blank lines and
    formatting (`trusted_file` runs it as the recorded code; replay notes it: line numbers in
    the report are today's)."""
    code = recorded_code(desc, run_dir)
    return code.same_tokens and not code.installed


def _copy_in_run(desc: dict, run_dir: Path) -> Path | None:
    """The recorded file as the run holds it (file_rel or its `sources/` copy), if present."""
    for rel in (desc.get("file_rel"), desc.get("source_copy")):
        if rel and (run_dir / rel).is_file():
            return (run_dir / rel).resolve()
    return None


def load(desc: dict, role: str, run_dir: Path, *, trust: bool = False) -> tuple[Callable, bool]:
    """(the recorded function, whether its file is unchanged since recording): imported when
    `trusted_file` allows it, saying which file's code it is (a WARNING: on stderr by default). ReplayError says what
    to do when it cannot."""
    module, qualname = desc.get("module"), desc.get("qualname")
    if not isinstance(module, str) or not isinstance(qualname, str):  # `describe` always writes both
        raise ReplayError(f"the run's manifest does not name the module and function of {role}", path=run_dir)
    path, unchanged = trusted_file(desc, role, run_dir, trust=trust)
    _announce(role, path or module, unchanged, layout=unchanged and layout_only(desc, run_dir))
    if module == "__main__" and path is None:
        raise ReplayError(
            f"the script that defined {role} ({desc.get('file')}) is gone",
            path=run_dir,
            hint="restore it, or run replay from the directory it was recorded in",
        )
    with _no_bytecode_in(run_dir, path):
        if module == "__main__":
            mod = _load_script(cast(Path, path))
        else:
            mod = _import(module, path, role, run_dir, verified=unchanged, recorded=desc)
    fn = _resolve(mod, qualname)
    if not callable(fn):
        raise ReplayError(
            f"{role} {module}.{qualname} no longer exists", path=run_dir, hint="restore the recorded code"
        )
    return fn, unchanged


@contextlib.contextmanager
def _no_bytecode_in(run_dir: Path, path: Path | None) -> Iterator[None]:
    """Python writes no bytecode while it imports a file the run directory holds (its
    `sources/` copy, or a script kept in the run): reading a run never changes it."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = before or (path is not None and path.resolve().is_relative_to(run_dir.resolve()))
    try:
        yield
    finally:
        sys.dont_write_bytecode = before


def _announce(role: str, path, unchanged: bool, *, layout: bool = False) -> None:
    if (role, path, layout) in _announced:
        return
    _announced.add((role, path, layout))
    how = (
        "the recorded code: changed since recording only in comments, blank lines or formatting"
        if layout
        else "unchanged since recording"
        if unchanged
        else f"NOT verified: trusted by {TRUST_FLAG}/{TRUST_ENV}"
    )
    log.warning("ckptlab: running %s from %s (%s)", role, path, how)


def _import(module: str, path: Path | None, role: str, run_dir: Path, *, verified: bool, recorded: dict):
    """Import `module` by name so that it is the file `path` (or a copy of it with the same
    sha256: an installed package beside its source checkout): its package root goes on
    sys.path, never a folder the manifest names (its recorded working directory only with the
    opt-in, when the file is not `verified`)."""
    root = _import_root(module, path) if path is not None else None
    extra = [] if verified or not recorded.get("cwd") else [recorded["cwd"]]
    for folder in [*extra, *([str(root)] if root is not None else [])]:
        if folder not in sys.path:
            sys.path.insert(0, folder)
    importlib.invalidate_caches()
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
        raise ReplayError(
            f"cannot import {module} for {role} ({type(e).__name__}: {e})",
            path=run_dir,
            hint="run replay where that module is importable (same environment and working directory)",
        ) from None
    found = getattr(mod, "__file__", None)
    same = found is not None and (Path(found).resolve() == path or sha256_file(found) == recorded.get("sha256"))
    if verified and not same:
        raise UntrustedCodeError(
            f"{module} imports from {found}, not from the recorded, unchanged {path}",
            path=run_dir,
            hint=f"run replay where {module} is that file, or pass {TRUST_FLAG}",
        )
    return mod


def _import_root(module: str, path: Path) -> Path | None:
    """The folder from which `module` imports as `path` (/p/pkg/mod.py for pkg.mod -> /p)."""
    parts = module.split(".")
    depth = len(parts) if path.name == "__init__.py" else len(parts) - 1
    if depth >= len(path.parents):
        return None
    root = path.parents[depth]
    expected = (
        root.joinpath(*parts[:-1], parts[-1] + ".py")
        if path.name != "__init__.py"
        else root.joinpath(*parts, "__init__.py")
    )
    return root if expected == path else None


def _load_script(path: Path):
    if path in _loaded_scripts:
        return _loaded_scripts[path]
    name = "ckptlab_replayed_" + hashlib.sha256(os.fsencode(path)).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # a script whose name does not end in .py
        raise ReplayError(f"cannot import {path.name}: not a Python source file (.py)", path=path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise ReplayError(f"importing {path.name} failed ({type(e).__name__}: {e})", path=path) from None
    _loaded_scripts[path] = mod
    return mod
