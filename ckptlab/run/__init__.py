"""The run directory: the only code that knows file layouts; all atomic writes live here.

`Run`, `open_run` and `Metrics` are imported when first used: `ckptlab show` (a dump file,
run/dumpfile.py) and anything else that needs only a layout stay torch-free."""

_LAZY = {"Metrics": "ckptlab.run.reader", "Run": "ckptlab.run.reader", "open_run": "ckptlab.run.reader"}

__all__ = ["Metrics", "Run", "open_run"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ckptlab.run' has no attribute {name!r}")
