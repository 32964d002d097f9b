import sys
from pathlib import Path

import pytest

# Shared helpers (trainer_helpers.py) live beside the tests; importlib mode needs the path.
sys.path.insert(0, str(Path(__file__).parent))

from trainer_helpers import MLA_MOE_MODEL

from k3_trainer import prepare_dataset


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The built-in corpus, prepared once for the whole session."""
    out = tmp_path_factory.mktemp("data") / "builtin"
    prepare_dataset([], out)
    return out


@pytest.fixture
def small_model_config():
    return MLA_MOE_MODEL
