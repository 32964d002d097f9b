"""The train command's walk: which of k3_trainer's modules run, in what order, from the
argument parser to the first optimizer step.


Every Python call made inside ``k3_trainer`` is traced (``sys.setprofile``) while
``k3-train train`` runs a fresh tiny run in a temporary folder, until MuonAdamW's first
``step``. The sequence of modules is cut into *stays* (maximal runs of calls in one
module); a *return* is a stay in a module already visited, so ``stays = modules +
returns``. Many returns mean control keeps coming back to the same places: the run's
logic is spread over modules that call each other back and forth. The command line's
share (``k3_trainer.cli``) says how much of the run still lives there.

    python scripts/train_walk.py [--show]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

COMMAND = "k3_trainer.cli.train"
"""The walk starts when the argument parser hands the parsed options to this module's
``run`` (flag generation, a table walk, is left out)."""


class _Reached(Exception):
    """The first optimizer step: the walk ends here."""


def walk(run_dir: Path) -> list[str]:
    """The modules of k3_trainer entered, in order (one entry per call)."""
    from k3_trainer.cli import main

    calls: list[str] = []
    started = False

    def profile(frame, event, arg):
        nonlocal started
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith("k3_optim") and frame.f_code.co_name == "step":
            raise _Reached
        started = started or (module.startswith(COMMAND) and frame.f_code.co_name == "run")
        if started and module.startswith("k3_trainer"):
            calls.append(module)

    sys.setprofile(profile)
    try:
        main(["train", "--run-dir", str(run_dir), "--max-steps", "1", "--batch-size", "2",
              "--seq-len", "32", "--eval-interval", "1"])
    except _Reached:
        pass
    finally:
        sys.setprofile(None)
    return calls


def stays(calls: list[str]) -> list[str]:
    out: list[str] = []
    for module in calls:
        if not out or out[-1] != module:
            out.append(module)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", action="store_true", help="print the stays in order")
    args = parser.parse_args()
    os.environ.setdefault("K3_TRAIN_CACHE", str(Path(tempfile.gettempdir()) / "k3-walk"))
    with tempfile.TemporaryDirectory() as folder:
        sequence = stays(walk(Path(folder) / "run"))
    modules = len(set(sequence))
    if args.show:
        for module in sequence:
            print(module)
    print(f"{len(sequence)} stays in {modules} modules: {len(sequence) - modules} returns")
    cli = [m for m in sequence if m.startswith("k3_trainer.cli")]
    print(f"the command line (k3_trainer.cli): {len(cli)} stays in {len(set(cli))} modules: "
          f"{len(cli) - len(set(cli))} returns")
    busiest = max(set(sequence), key=sequence.count)
    print(f"entered most: {busiest} ({sequence.count(busiest)} times)")


if __name__ == "__main__":
    main()
