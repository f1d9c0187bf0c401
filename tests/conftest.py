import os
from pathlib import Path

import pytest
import torch

from helpers import write_prompts

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor-cache"))
# tiny test models run fastest on one thread, and 2-thread OpenMP spinning collapses when the
# machine's two cores are shared (measured 10-30x slower steps)
torch.set_num_threads(1)


@pytest.fixture
def prompts_file(tmp_path):
    return lambda prompts: write_prompts(tmp_path / "prompts.jsonl", prompts)
