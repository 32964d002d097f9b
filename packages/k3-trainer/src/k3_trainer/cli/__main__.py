"""``python -m k3_trainer.cli``: how ``k3-train --nproc`` reruns itself under torchrun."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
