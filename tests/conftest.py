import sys
from pathlib import Path

import pytest

# The shared helpers (harness.py) live beside the tests; importlib mode needs the path.
sys.path.insert(0, str(Path(__file__).parent))

from harness import toml_text

from k3_trainer import prepare_dataset


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The built-in corpus, prepared once for the whole session (read-only shards)."""
    out = tmp_path_factory.mktemp("data") / "builtin"
    prepare_dataset([], out)
    return out


@pytest.fixture(scope="session")
def code_dir(tmp_path_factory):
    """A second byte-level dataset of many short documents (functions): a mixture's other
    source, whose rows pack several documents each."""
    root = tmp_path_factory.mktemp("code")
    docs = root / "docs"
    docs.mkdir()
    for i in range(400):
        (docs / f"{i:03d}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n")
    prepare_dataset([str(docs)], root / "data")
    return root / "data"


@pytest.fixture(scope="session")
def small_toml(tmp_path_factory):
    """A ``--config`` file for the small model (batch 4×16); schedules come from flags."""
    path = tmp_path_factory.mktemp("config") / "small.toml"
    path.write_text(toml_text())
    return path
