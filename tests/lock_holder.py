"""A process that holds a run's lock: it opens a Recorder on RUN (resuming it) and waits.

    python -c "from tests import lock_holder; lock_holder.main()" RUN

Prints "ready PID" once the Recorder is open, then waits for a line on stdin (or a SIGKILL
from the test); on "close" it closes the Recorder and prints "closed".
"""

from __future__ import annotations

import os
import sys

import ckptlab
from tests import models


def main() -> None:
    run_dir = sys.argv[1]
    model, opt = models.build_mlp()
    rec = ckptlab.Recorder(run_dir, model, opt, step_fn=models.step_mlp, build_fn=models.build_mlp, resume=True)
    print(f"ready {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() == "close":
        rec.close()
        print("closed", flush=True)
