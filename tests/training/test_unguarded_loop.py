"""Recording a function of a script run as `__main__` warns about a top-level loop (or `with`
block) that trains, since replay imports the script; a loop or `with` that trains nothing (over
sys.path, reading a config) is left alone."""

import ast
import sys
import warnings

import pytest

from ckptlab.training import userfns

STEP = """

def step(model, optimizer, batch):
    loss = model(batch).sum()
    loss.backward()
    optimizer.step()
    return loss
"""

HARMLESS = (
    """import json
import sys

for p in sys.path:
    if p.endswith("site-packages"):
        break
with open(__file__) as f:
    HEADER = f.readline()
"""
    + STEP
    + """

if __name__ == "__main__":
    with open("config.json") as f:
        config = json.load(f)
"""
)


def _warnings_of(tmp_path, monkeypatch, source: str) -> list[str]:
    """What recording `step` of `source`, a script run as __main__, warns."""
    path = tmp_path / "train.py"
    path.write_text(source)
    tree = ast.parse(source)  # only the defs run: the script's top level is what is checked
    tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    namespace = {"__name__": "__main__"}
    exec(compile(tree, str(path), "exec"), namespace)
    monkeypatch.setattr(sys.modules["__main__"], "step", namespace["step"], raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        userfns.describe(namespace["step"], "step_fn", tmp_path / "run")
    return [str(w.message) for w in caught]


def test_a_loop_over_sys_path_and_a_with_open_are_not_training(tmp_path, monkeypatch):
    assert _warnings_of(tmp_path, monkeypatch, HARMLESS) == []


@pytest.mark.parametrize(
    "loop, says",
    [
        (
            "with ckptlab.Recorder('runs/x', model, opt, step_fn=step) as rec:\n"
            "    for batch in data:\n"
            "        rec.step(batch)\n",
            "top-level `with` block that trains (it calls rec.step())",
        ),
        (
            "def train_one_epoch():\n    for batch in data:\n        step(model, opt, batch)\n\n\n"
            "for epoch in range(3):\n    train_one_epoch()\n",
            "top-level loop that trains (it calls train_one_epoch())",
        ),
        (
            "while True:\n    if ready:\n        trainer.fit(model)\n",
            "top-level loop that trains (it calls trainer.fit())",
        ),
    ],
    ids=["recorder", "own-function", "lightning"],
)
def test_a_top_level_training_loop_is_warned_about(tmp_path, monkeypatch, loop, says):
    """After the harmless loops, so the warning names the line of the one that trains."""
    source = HARMLESS.replace("\n\nif __name__", "\n" + loop + "\n\nif __name__")
    first = next(x for x in loop.splitlines() if x.startswith(("for", "while", "with")))
    lineno = source.splitlines().index(first) + 1
    assert _warnings_of(tmp_path, monkeypatch, source) == [
        f"train.py:{lineno}: {says}; replay imports this script, so put the training loop under "
        '`if __name__ == "__main__":`'
    ]
