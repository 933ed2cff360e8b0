import os

import pytest
import torch

# Tests run on the CPU with a fixed thread count: replay must match bits recorded here.
torch.set_num_threads(1)
os.environ.setdefault("CKPTLAB_DEBUG", "0")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"
