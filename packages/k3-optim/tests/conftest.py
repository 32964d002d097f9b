import sys
from pathlib import Path

# Test helpers (optim_reference.py) live beside the tests; importlib mode needs the path.
sys.path.insert(0, str(Path(__file__).parent))
