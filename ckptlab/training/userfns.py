"""The user's `build_fn` and `step_fn`: recorded by name and hash, imported again for replay.

Recording stores module, qualname, the defining file (absolute, and relative to the run
directory so a moved project still resolves), the file's sha256 and a copy of it under
`sources/`. Replay imports the module by name, or, for a script run as `__main__`, loads the
script file under another module name (so its `if __name__ == "__main__":` block does not
run). Nothing else from a run directory is ever executed; see docs/run-format.md.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from ckptlab.errors import RecordError, ReplayError
from ckptlab.run.layout import sources_dir, write_bytes_atomic
from ckptlab.run.manifest import resolve_file


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
    file = inspect.getsourcefile(fn) or getattr(mod, "__file__", None)
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


def _warn_unguarded(path: Path, source: bytes) -> None:
    """Replay imports the script; a training loop at its top level would start training."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in tree.body:
        if isinstance(node, (ast.For, ast.While, ast.With, ast.AsyncFor, ast.AsyncWith)):
            warnings.warn(
                f"{path.name}:{node.lineno}: top-level loop; replay imports this script, so put the "
                'training loop under `if __name__ == "__main__":`',
                stacklevel=4,
            )
            return


_loaded_scripts: dict[Path, object] = {}


def load(desc: dict, role: str, run_dir: Path) -> Callable:
    """Import the recorded function. ReplayError says what to do when it cannot."""
    module, qualname = desc.get("module"), desc.get("qualname")
    path = resolve_file(desc, run_dir)
    for p in {desc.get("cwd"), str(path.parent) if path else None} - {None}:
        if p not in sys.path:
            sys.path.insert(0, p)
    if module == "__main__":
        if path is None:
            raise ReplayError(
                f"the script that defined {role} ({desc.get('file')}) is gone",
                path=run_dir,
                hint="restore it, or run replay from the directory it was recorded in",
            )
        mod = _load_script(path)
    else:
        try:
            mod = importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure is the user's to fix
            raise ReplayError(
                f"cannot import {module} for {role} ({type(e).__name__}: {e})",
                path=run_dir,
                hint="run replay where that module is importable (same environment and working directory)",
            ) from None
    fn = _resolve(mod, qualname)
    if not callable(fn):
        raise ReplayError(
            f"{role} {module}.{qualname} no longer exists", path=run_dir, hint="restore the recorded code"
        )
    return fn


def _load_script(path: Path):
    if path in _loaded_scripts:
        return _loaded_scripts[path]
    name = "ckptlab_replayed_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        del sys.modules[name]
        raise ReplayError(f"importing {path.name} failed ({type(e).__name__}: {e})", path=path) from None
    _loaded_scripts[path] = mod
    return mod
