"""A run's checkpoints over time: a folder per saved step and a ``latest`` pointer.

::

    checkpoints/
        step-00000100/k3.ckpt                one process or DDP: one format-7 file
        step-00000200/.metadata, __0_0.distcp, ..., k3.ckpt     FSDP2: a sharded folder
        latest -> step-00000200              a symlink, moved by one rename
        superseded-1/step-00000300/          a branch's abandoned checkpoints

A save is written into the hidden ``.step-NNNNNNNN.tmp``, then renamed to its step name
and the folder fsynced; only then does ``latest`` move (a new symlink renamed over it),
and only after that are old checkpoints pruned: the newest ``keep_last`` stay, with every
step that is a multiple of ``keep_every`` (milestones, never deleted) and whatever
``latest`` names. A kill at any point leaves ``latest`` naming a complete checkpoint.

The same step saved twice (a session resumed and stopped before its first update) gets
``step-NNNNNNNN.1``, ``.2`` … . Continuing from a checkpoint moves every one written after
it into ``superseded-N/`` (nothing is deleted), so the folder always holds one line of
checkpoints and their order by (step, repeat) is the order they were written in.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import k3_checkpoint

HISTORY = "checkpoints"
"""A run directory's checkpoint history."""
LATEST = "latest"
"""The symlink naming the newest durable checkpoint."""
META = "k3.ckpt"
"""The format-7 file every checkpoint folder holds (with the shards of a sharded one)."""

_ENTRY = re.compile(r"step-(\d{8,})(?:\.(\d+))?")
_SUPERSEDED = re.compile(r"superseded-(\d+)")


@dataclass(frozen=True, order=True)
class Entry:
    """One checkpoint of the history, ordered as written."""

    step: int
    repeat: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


def entry_name(step: int, repeat: int = 0) -> str:
    return f"step-{step:08d}" + (f".{repeat}" if repeat else "")


class CheckpointHistory:
    """The checkpoints of one run under ``root`` (``run_dir/checkpoints``).

    ``keep_last`` (≥ 1): how many of the newest checkpoints stay (1: the previous
    behaviour, one checkpoint); ``keep_every`` (None or ≥ 1): steps that are multiples of
    it are milestones, never pruned.
    """

    def __init__(self, root: str | os.PathLike[str], keep_last: int = 1,
                 keep_every: int | None = None) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        if keep_every is not None and (isinstance(keep_every, bool)
                                       or not isinstance(keep_every, int) or keep_every < 1):
            raise ValueError(f"keep_every must be None or an integer >= 1, got {keep_every!r}")
        self.root = Path(root)
        self.keep_last, self.keep_every = keep_last, keep_every

    # --- reading ---------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """Every complete checkpoint, oldest first (superseded ones excluded)."""
        found = []
        try:
            children = list(self.root.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        for child in children:
            match = _ENTRY.fullmatch(child.name)
            if match and not child.is_symlink() and (child / META).is_file():
                found.append(Entry(int(match[1]), int(match[2] or 0), child))
        return sorted(found)

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names; when it names nothing complete (a kill inside a
        branch's reorganization), the newest checkpoint there is."""
        link = self.root / LATEST
        if link.is_symlink():
            target = self.root / os.readlink(link)
            if _ENTRY.fullmatch(target.name) and (target / META).is_file():
                return target
        entries = self.entries()
        return entries[-1].path if entries else None

    def at_step(self, step: int) -> Path | None:
        """The checkpoint of ``step`` (its newest repeat), or None."""
        matching = [e for e in self.entries() if e.step == step]
        return matching[-1].path if matching else None

    def steps(self) -> list[int]:
        return sorted({e.step for e in self.entries()})

    # --- writing (the main rank only) --------------------------------------------------------

    def staging(self, step: int) -> Path:
        """The hidden folder the checkpoint of ``step`` is written into."""
        return self.root / f".{entry_name(step)}.tmp"

    def stage(self, step: int) -> Path:
        """A fresh, empty :meth:`staging` folder (a killed save's leftovers removed)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        staged = self.staging(step)
        staged.mkdir()
        return staged

    def discard(self, staged: Path) -> None:
        """A failed save's staging folder: removed at once (a full disk gets its space
        back)."""
        shutil.rmtree(staged, ignore_errors=True)

    def describe(self, step: int) -> tuple[Path, Path | None]:
        """What a failed save of ``step`` names: its would-be folder and the latest
        checkpoint, which it left as it was."""
        return self.root / entry_name(step), self.latest()

    def publish(self, staged: Path, step: int) -> Path:
        """Name the written checkpoint by its step, make it durable, point ``latest`` at it,
        then prune. Returns its path."""
        k3_checkpoint.fsync_directory(staged)
        taken = {e.repeat for e in self.entries() if e.step == step}
        repeat = max(taken) + 1 if taken else 0
        final = self.root / entry_name(step, repeat)
        os.rename(staged, final)
        k3_checkpoint.fsync_directory(self.root)
        self._point_at(final)
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Remove what retention no longer keeps; returns the removed folders."""
        entries = self.entries()
        keep = {e.path for e in entries[-self.keep_last:]}
        latest = self.latest()
        keep |= {latest} if latest is not None else set()
        if self.keep_every is not None:
            keep |= {e.path for e in entries if e.step % self.keep_every == 0}
        removed = [e.path for e in entries if e.path not in keep]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        return removed

    def continue_from(self, checkpoint: Path) -> list[Path]:
        """Make ``checkpoint`` (one of this history's) the latest: every checkpoint written
        after it moves into a new ``superseded-N/`` folder, kept whole. Returns the moved
        folders (none when ``checkpoint`` is already the newest)."""
        entries = self.entries()
        mine = next((e for e in entries if e.path.resolve() == checkpoint.resolve()), None)
        if mine is None:
            raise ValueError(f"{checkpoint} is not a checkpoint of {self.root}")
        later = [e for e in entries if e > mine]
        moved = []
        if later:
            folder = self.root / f"superseded-{self._next_branch()}"
            folder.mkdir()
            for entry in later:  # latest may dangle meanwhile: it then reads as the newest
                moved.append(folder / entry.name)
                os.rename(entry.path, moved[-1])
            k3_checkpoint.fsync_directory(self.root)
        link = self.root / LATEST
        # The link itself, not latest(): a link left dangling by the move reads as the
        # newest checkpoint there, which is ``mine``, and would never be re-pointed.
        if not link.is_symlink() or os.readlink(link) != mine.path.name:
            self._point_at(mine.path)
        return moved

    def _next_branch(self) -> int:
        numbers = [int(m[1]) for p in self.root.iterdir()
                   if (m := _SUPERSEDED.fullmatch(p.name))]
        return max(numbers, default=0) + 1

    def _point_at(self, target: Path) -> None:
        link, latest = self.root / f".{LATEST}.new", self.root / LATEST
        link.unlink(missing_ok=True)
        os.symlink(target.name, link)
        if latest.is_dir() and not latest.is_symlink():
            # A copy that followed the symlink (cp -rL, shutil.copytree): a duplicate of a
            # step folder, never read as the pointer; meanwhile the newest one stands in.
            shutil.rmtree(latest)
        os.replace(link, latest)
        k3_checkpoint.fsync_directory(self.root)
