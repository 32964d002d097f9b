"""``python -m k3_trainer.cli``: how ``k3-train --nproc`` reruns itself under torchrun (also a
script path for torchrun's ``--run-path``, so the import is absolute)."""

import sys

from k3_trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
