"""manifest.json: what recorded the run and how. Written atomically; read with validation.

Keys (format_version 2, as in 1): format, format_version, created, versions{ckptlab, torch, numpy,
python, platform, cuda}, host, device, world_size, data_ranks (tensor parallelism: each process's
data-parallel rank), config{ckpt_every, health_every, keep_last,
...}, functions{build_fn, step_fn} (module, qualname, file, file_rel, sha256, source_file),
parameters[{name, shape, dtype, requires_grad, group}], param_groups, optimizers[{key, class,
groups}] (`OptimizerGroups` reads the two), data_info, env (the execution
settings at the start), environment (where it was recorded: CPU, ATen's CPU capability, torch build,
GPU, deterministic flags; run/environment.py), sessions[{session, start_step, started, pid, host, restored_from}],
rollback (null, or the step a rollback rewound the run to).
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import platform
import socket
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

from ckptlab.errors import CorruptFileError, FormatVersionError, NotARunError
from ckptlab.io.files import open_regular, read_bytes
from ckptlab.jsonable import is_int, is_number
from ckptlab.run.atomic import write_json_atomic
from ckptlab.run.environment import capture as capture_environment
from ckptlab.run.hashing import sha256_file
from ckptlab.run.layout import FORMAT_VERSION, MANIFEST

FORMAT = "ckptlab-run"


def versions() -> dict:
    import numpy
    import torch

    from ckptlab import __version__

    return {
        "ckptlab": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.version.cuda,
    }


def new_manifest(**fields) -> dict:
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.time(),
        "versions": versions(),
        "environment": capture_environment(),
        "host": socket.gethostname(),
        "argv": list(sys.argv),
        "world_size": 1,
        "sessions": [],
        "rollback": None,
    }
    manifest.update(fields)
    return manifest


def data_group(manifest: dict, rank: int | None) -> dict:
    """How a report names process `rank`: {"rank": its data-parallel rank, "processes": the
    processes of that rank (they train on one batch)} under tensor parallelism (`data_ranks`),
    else {"rank": rank, "processes": None}."""
    data_ranks = manifest.get("data_ranks")
    if rank is None or not data_ranks:
        return {"rank": rank, "processes": None}
    return {"rank": data_ranks[rank], "processes": [r for r, d in enumerate(data_ranks) if d == data_ranks[rank]]}


def read_manifest(run_dir: Path) -> dict:
    path = run_dir / MANIFEST
    if not run_dir.is_dir():
        raise NotARunError("no such directory", path=run_dir)
    if not path.exists():
        raise NotARunError("not a ckptlab run (no manifest.json)", path=run_dir)
    try:
        with open_regular(path) as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"unreadable manifest ({e})", path=path) from None
    except RecursionError:
        raise CorruptFileError("unreadable manifest (JSON nested too deeply)", path=path) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise NotARunError("manifest.json is not a ckptlab run manifest", path=path)
    version = manifest.get("format_version")
    if not is_int(version) or version < 1:
        raise CorruptFileError("manifest has no valid format_version", path=path)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"written by a newer ckptlab (run format {version}; this ckptlab reads up to {FORMAT_VERSION})",
            path=run_dir,
            hint="upgrade ckptlab",
        )
    _check_types(manifest, path)
    return manifest


def _check_types(manifest: dict, path: Path) -> None:
    """The manifest fields readers rely on have their types (CorruptFileError naming the field
    otherwise): a hand-edited or crafted manifest is one clear line, not an error deep inside
    an analysis. Absent fields stay absent (older runs)."""

    def bad(what: str) -> CorruptFileError:
        return CorruptFileError(f"malformed manifest: {what}", path=path)

    for key, kind in (("config", dict), ("functions", dict), ("versions", dict), ("sessions", list)):
        if key in manifest and not isinstance(manifest[key], kind):
            raise bad(f"{key!r} is not {'an object' if kind is dict else 'a list'}")
    if "parameters" in manifest and not isinstance(manifest["parameters"], list):
        raise bad("'parameters' is not a list")
    for p in manifest.get("parameters", []):
        if not isinstance(p, dict) or not isinstance(p.get("name"), str):
            raise bad("a parameter without a name")
        if "shape" in p and not (isinstance(p["shape"], list) and all(is_int(d) and d >= 0 for d in p["shape"])):
            raise bad(f"parameter {p['name']!r} has a malformed shape")
    for sess in manifest.get("sessions", []):
        if not isinstance(sess, dict) or not is_int(sess.get("session")):
            raise bad("a session without an integer number")
        if "start_step" in sess and not is_int(sess["start_step"]):
            raise bad(f"session {sess['session']}'s start_step is not an integer")
        if sess.get("closed") is not None and not is_number(sess["closed"]):
            raise bad("a session's 'closed' time is not a number")
    _check_optimizers(manifest, bad)
    if "world_size" in manifest and not (is_int(manifest["world_size"]) and manifest["world_size"] >= 1):
        raise bad("'world_size' is not a positive integer")
    data_ranks = manifest.get("data_ranks")
    if data_ranks is not None and not (
        isinstance(data_ranks, list)
        and len(data_ranks) == manifest.get("world_size", 1)
        and all(is_int(r) and 0 <= r < len(data_ranks) for r in data_ranks)
    ):
        raise bad("'data_ranks' is not one data-parallel rank per process")
    created = manifest.get("created")
    if created is not None and not (is_number(created) and math.isfinite(created)):
        raise bad("'created' is not a time")
    for role, desc in manifest.get("functions", {}).items():
        if not isinstance(desc, dict):
            raise bad(f"functions.{role} is not an object")
    config = manifest.get("config", {})
    for key in ("val_metric", "val_mode", "update_ratio", "health_read", "ckpt_snapshot"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise bad(f"config.{key} is not a string")
    for key, least in (("ckpt_every", 1), ("health_every", 1), ("keep_last", 0)):
        if config.get(key) is not None and not (is_int(config[key]) and config[key] >= least):
            raise bad(f"config.{key} is not an integer >= {least}")
    info = manifest.get("data_info")
    if info is not None:
        if not isinstance(info, dict):
            raise bad("'data_info' is not an object")
        for key in ("pad_id", "vocab_size", "ignore_index"):
            if info.get(key) is not None and not is_int(info[key]):
                raise bad(f"data_info.{key} is not an integer")
        if info.get("vocab_size") is not None and info["vocab_size"] < 1:
            raise bad("data_info.vocab_size is not positive")


def _check_optimizers(manifest: dict, bad) -> None:
    """`optimizers` and each parameter's `group` (runs recorded before them have neither)."""
    optimizers = manifest.get("optimizers", [])
    if not isinstance(optimizers, list):
        raise bad("'optimizers' is not a list")
    for o in optimizers:
        if not isinstance(o, dict) or not (o.get("key") is None or isinstance(o["key"], str) or is_int(o["key"])):
            raise bad("an optimizer whose key is not a string, an integer or null")
        if not (isinstance(o.get("groups"), list) and all(is_int(g) and g >= 0 for g in o["groups"])):
            raise bad(f"optimizer {o['key']!r} has malformed groups")
    for p in manifest.get("parameters", []):
        if p.get("group") is not None and not (is_int(p["group"]) and p["group"] >= 0):
            raise bad(f"parameter {p['name']!r} has a malformed group")


@dataclass(frozen=True)
class OptimizerGroups:
    """Which optimizer each parameter group belongs to, and which group each parameter is in,
    as the manifest says (runs recorded before it said so: one optimizer, groups unknown).
    A group `g` is an index into every step's `lr` list: the optimizers' groups in order."""

    keys: list  # each optimizer's key: its index in a list, its key in a dict; [None]: one alone
    groups: list[list[int]]  # each optimizer's groups
    of_parameter: dict[str, int]  # parameter name -> its group

    @classmethod
    def of(cls, manifest: dict) -> OptimizerGroups:
        found = manifest.get("optimizers") or [{"key": None, "class": "", "groups": []}]
        of_parameter = {p["name"]: p["group"] for p in manifest.get("parameters", []) if p.get("group") is not None}
        return cls(
            [o.get("key") for o in found],
            [o["groups"] for o in found],
            of_parameter,
        )

    @property
    def several(self) -> bool:
        """The optimizers were given as a list or a dict (of any length)."""
        return self.keys != [None]

    def where(self, group: int | None) -> tuple:
        """(the optimizer's key, the group's index in that optimizer) of group `group`: the
        key None for one optimizer alone; (None, None) when not known."""
        if group is None:
            return None, None
        for key, groups in zip(self.keys, self.groups):
            if group in groups:
                return key, groups.index(group)
        return (None, group) if not self.several else (None, None)


def write_manifest(run_dir: Path, manifest: dict) -> None:
    write_json_atomic(run_dir / MANIFEST, manifest)


# --- the recorded build_fn / step_fn (recorded and imported by training/userfns.py) ---------------


def file_candidates(desc: dict, run_dir: Path) -> list[Path]:
    """Where a recorded function's file may be now, most likely first: its recorded absolute
    path; the same place under the current directory as under the recorded working directory
    (a moved project, run from its root); the recorded path relative to the run directory
    (project and runs moved together). Never a file inside the run directory: a run is data,
    and code that came inside one is not the user's own (see training/userfns.py)."""
    out = []
    if desc.get("file"):
        out.append(Path(desc["file"]))
        if desc.get("cwd"):
            rel = os.path.relpath(desc["file"], desc["cwd"])
            if not rel.startswith(os.pardir):
                out.append(Path.cwd() / rel)
    if desc.get("file_rel"):
        out.append(run_dir / desc["file_rel"])
    return [p for p in out if not inside(p, run_dir)]


def inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or within it, once links and `..` are resolved."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))


def resolve_file(desc: dict, run_dir: Path) -> Path | None:
    """Where a recorded function's file is now (the first of `file_candidates` that exists)."""
    for candidate in file_candidates(desc, run_dir):
        if candidate.is_file():
            return candidate.resolve()
    return None


@dataclass(frozen=True)
class RecordedCode:
    """A recorded function's code as replay finds it today: the one answer `ckptlab info` shows
    and replay's trust rule (training/userfns.py: `trusted_file`) acts on."""

    path: Path | None  # the file whose code replay runs (None: not on this machine)
    installed: bool  # ckptlab's own module (an integration, an example): the installed version
    changed: bool | None  # its bytes differ from the recorded sha256 (None: cannot tell)
    same_tokens: bool = False  # changed, but only in comments, blank lines and formatting
    compared: bool = False  # changed, and its code was compared with the run's copy of the recorded file


def recorded_code(desc: dict, run_dir: Path) -> RecordedCode:
    """Where `desc`'s function is now: ckptlab's installed module for a `ckptlab.*` module
    (an upgrade changes it without making it anyone else's code), else `resolve_file`; and
    whether it changed since recording, and how (`same_tokens`: `same_code_tokens` against
    the run's copy of the recorded file, when that copy has the recorded hash)."""
    sha = desc.get("sha256")
    own = ckptlab_module_file(desc.get("module"))
    path = own if own is not None else resolve_file(desc, run_dir)
    if path is None or not sha:
        return RecordedCode(path, own is not None, None)
    if sha256_file(path) == sha:
        return RecordedCode(path, own is not None, False)
    same = _same_tokens_as_recorded(path, desc, run_dir)
    return RecordedCode(path, own is not None, True, bool(same), compared=same is not None)


def ckptlab_module_file(module) -> Path | None:
    """The installed file of a ckptlab module (`ckptlab.examples.tiny_lm`), else None."""
    if not isinstance(module, str) or not module.startswith("ckptlab."):
        return None
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    package = Path(__file__).resolve().parents[1]
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    return origin if origin is not None and origin.is_relative_to(package) else None


# A recorded copy larger than this is not tokenized (a source file is kilobytes; a run is data).
MAX_TOKENIZED_BYTES = 8 << 20


def _same_tokens_as_recorded(path: Path, desc: dict, run_dir: Path) -> bool | None:
    """`path` holds the recorded code, changed only in comments, blank lines and formatting:
    compared with the run's copy of the recorded file (`source_copy`), read as data and only
    when it has the recorded sha256 (never imported). None: no such copy to compare with."""
    rel = desc.get("source_copy")
    copy = run_dir / rel if isinstance(rel, str) and rel else None
    try:
        if copy is None or not copy.is_file() or copy.stat().st_size > MAX_TOKENIZED_BYTES:
            return None
        if sha256_file(copy) != desc.get("sha256"):
            return None
        if path.stat().st_size > MAX_TOKENIZED_BYTES:
            return False
        return same_code_tokens(read_bytes(copy), read_bytes(path))
    except OSError:
        return None


def same_code_tokens(recorded: bytes, today: bytes) -> bool:
    """The two sources are the same Python code: the same tokens in the same order, whatever
    their comments, blank lines, spacing within a line, line continuations and indentation
    width (INDENT/DEDENT say the block structure; their whitespace does not count). A string,
    a name, a number or a docstring that changed is a change; so is a file Python cannot
    tokenize."""
    a, b = _code_tokens(recorded), _code_tokens(today)
    return a is not None and a == b


_LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING}
_WHITESPACE = {tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.ENDMARKER}


def _code_tokens(source: bytes) -> list[tuple[int, str]] | None:
    try:
        tokens = list(tokenize.tokenize(io.BytesIO(source).readline))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    return [(t.type, "" if t.type in _WHITESPACE else t.string) for t in tokens if t.type not in _LAYOUT]
