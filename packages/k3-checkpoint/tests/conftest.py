import random
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# Test helpers (ckpt_helpers.py) live beside the tests; importlib mode needs the path.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _isolate_global_state() -> Iterator[None]:
    """Tests set threads, determinism and seeds; put them back so tests stay independent."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    python, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
