"""The run directory: the only code that knows file layouts; all atomic writes live here."""

from ckptlab.run.reader import Metrics, Run, open_run

__all__ = ["Metrics", "Run", "open_run"]
