"""``k3-train`` in a real process, with test-only fault injection around the same ``main``.

Usage: ``python cli_driver.py ARGS...`` (the arguments of ``k3-train``). Without any of the
variables below it behaves exactly like ``python -m k3_trainer.cli ARGS...``.

- ``K3_TEST_OPEN_LOG=FILE``: append ``pid<TAB>mode<TAB>flags<TAB>path`` to FILE for every
  open of a checkpoint file (``k3.ckpt`` of a history, a run's ``checkpoint.pt`` from
  before the history, or either's ``.tmp``; a Python audit hook), so a test can prove what
  was read.
- ``K3_TEST_KILL=POINT:N``: SIGKILL this process inside its N-th checkpoint write, which
  stages ``checkpoints/.step-NNNNNNNN.tmp/k3.ckpt.tmp``, renames it to ``k3.ckpt``, renames
  the folder to ``step-NNNNNNNN``, then moves ``latest`` (``.latest.new`` renamed over it):
  ``mid-payload`` (half of the payload bytes written, flushed, and fsynced where the stream
  has a descriptor), ``before-rename`` (the ``.tmp`` complete and fsynced, not yet
  renamed), ``before-publish`` (the hidden folder complete, not yet renamed to its step
  name), ``before-latest`` (the step folder named, ``latest`` not yet moved) or
  ``after-rename`` (published: ``latest`` moved, the directory not yet fsynced). A
  single-file checkpoint (``checkpoint.pt``, a library's ``checkpoint_path``) has the
  first two and ``after-rename`` (its ``.tmp`` renamed).
- ``K3_TEST_KILL_RANK=R:sharded-write:N``: in the torchrun rank R only, SIGKILL this
  process inside its N-th sharded checkpoint write, once its shards are on disk and
  before the checkpoint is published.
- ``K3_TEST_QK_NONFINITE=R:N``: in the torchrun rank R only, the N-th update's QK-Clip
  check finds an infinite max logit: its first observing attention module reports +inf
  for every head (through the module's public ``qk_observer``), as a forward that
  overflowed would.
- ``K3_TEST_READONLY=DIR``: every write inside DIR fails with EACCES, as in a read-only
  directory (an audit hook, so it holds for root too, which ignores permission bits).
- ``K3_TEST_FSIZE=BYTES``: no file may grow beyond BYTES (RLIMIT_FSIZE), like a disk that
  fills up during a write.
- ``K3_TEST_THREADS=N``: ``torch.set_num_threads(N)`` first (unlike ``OMP_NUM_THREADS``,
  which torch caps at the number of cores, any N sticks).
"""

from __future__ import annotations

import errno
import io
import os
import signal
import sys


def _log_checkpoint_opens(log_path: str) -> None:
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.getpid()

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            if "checkpoint.pt" in path or "k3.ckpt" in path:
                os.write(descriptor, f"{pid}\t{args[1]}\t{args[2]}\t{path}\n".encode())

    sys.addaudithook(hook)


def _is_staged_file(path: str) -> bool:
    """The ``.tmp`` of a checkpoint file (``k3.ckpt.tmp``, ``checkpoint.pt.tmp``)."""
    return path.endswith((".ckpt.tmp", ".pt.tmp"))


def _is_staged_folder(path: str) -> bool:
    """A history's hidden ``.step-NNNNNNNN.tmp`` folder."""
    name = os.path.basename(path)
    return name.startswith(".step-") and name.endswith(".tmp")


def _is_latest_swap(path: str) -> bool:
    """The new ``latest`` symlink of a history, renamed over the old one."""
    return os.path.basename(path) == ".latest.new"


def _publishes(path: str) -> bool:
    """A rename that makes a checkpoint the one a resume finds: ``latest`` moved, or a
    single file's ``.tmp`` renamed (but not one inside a history's hidden folder)."""
    return _is_latest_swap(path) or (_is_staged_file(path)
                                     and not _is_staged_folder(os.path.dirname(path)))


def _kill_inside_checkpoint_write(spec: str) -> None:
    point, _, count = spec.partition(":")
    target = int(count or 1)
    seen = 0

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "mid-payload":
        import torch

        real_save = torch.save

        def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal seen
            if isinstance(obj, dict) and "format_version" in obj:  # a checkpoint's payload
                seen += 1
                if seen == target:
                    buffer = io.BytesIO()
                    real_save(obj, buffer, *args, **kwargs)
                    data = buffer.getvalue()
                    f.write(data[: len(data) // 2])
                    f.flush()
                    if hasattr(f, "fileno"):  # SIGKILL keeps what was written anyway
                        os.fsync(f.fileno())
                    die()
            return real_save(obj, f, *args, **kwargs)

        torch.save = save
        return
    # Each kill point: the os call it happens at, the renamed paths it counts, and whether
    # it dies before the rename (or right after it).
    points = {
        "before-rename": ("replace", _is_staged_file, True),
        "before-publish": ("rename", _is_staged_folder, True),
        "before-latest": ("replace", _is_latest_swap, True),
        "after-rename": ("replace", _publishes, False),
    }
    if point not in points:
        raise SystemExit(f"cli_driver: unknown kill point {point!r}")
    name, matches, before = points[point]
    real = getattr(os, name)

    def renaming(source, destination, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal seen
        if not matches(os.fspath(source)):
            return real(source, destination, *args, **kwargs)
        seen += 1
        if seen == target and before:
            die()
        real(source, destination, *args, **kwargs)
        if seen == target:
            die()
        return None

    setattr(os, name, renaming)


def _kill_rank_inside_sharded_write(spec: str) -> None:
    rank, point, count = spec.split(":")
    if point != "sharded-write":
        raise SystemExit(f"cli_driver: unknown rank kill point {point!r}")
    if os.environ.get("RANK") != rank:
        return
    from k3_trainer.checkpoint.sharded import write as sharded  # where seal looks it up

    real_hash_files, seen = sharded.hash_files, 0

    def hash_files(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal seen
        seen += 1
        if seen == int(count):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_hash_files(*args, **kwargs)

    sharded.hash_files = hash_files


def _read_only(directory: str) -> None:
    root = os.path.realpath(directory)
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path: object) -> bool:
        if not isinstance(path, (str, bytes, os.PathLike)):
            return False
        real = os.path.realpath(os.fsdecode(path))
        return real == root or real.startswith(root + os.sep)

    def refuse(path: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fsdecode(path))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            wants_write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & writing)
            if wants_write and inside(path):
                refuse(path)
        elif event == "os.rename":
            if inside(args[0]) or inside(args[1]):
                refuse(args[1])
        elif event == "os.mkdir":
            if inside(args[0]) and not os.path.exists(os.fsdecode(args[0])):
                refuse(args[0])
        elif event in ("os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.utime",
                       "os.symlink", "os.link") and inside(args[0]):
            refuse(args[0])

    sys.addaudithook(hook)


def _file_size_limit(limit: int) -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failing write(), not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def _non_finite_qk_logit(spec: str) -> None:
    rank, _, count = spec.partition(":")
    if os.environ.get("RANK") != rank:
        return
    import math

    import torch

    from k3_qkclip import QKClip

    original, calls = QKClip.nonfinite, [0]

    def nonfinite(self: QKClip) -> torch.Tensor | None:
        calls[0] += 1
        if calls[0] == int(count):
            observers = [m.qk_observer for m in self.model.modules()
                         if getattr(m, "qk_observer", None) is not None]
            observers[0].record(torch.full((observers[0].n_heads,), math.inf))
        return original(self)

    QKClip.nonfinite = nonfinite  # type: ignore[method-assign]


def main() -> int:
    if os.environ.get("K3_TEST_OPEN_LOG"):
        _log_checkpoint_opens(os.environ["K3_TEST_OPEN_LOG"])
    if os.environ.get("K3_TEST_KILL"):
        _kill_inside_checkpoint_write(os.environ["K3_TEST_KILL"])
    if os.environ.get("K3_TEST_KILL_RANK"):
        _kill_rank_inside_sharded_write(os.environ["K3_TEST_KILL_RANK"])
    if os.environ.get("K3_TEST_QK_NONFINITE"):
        _non_finite_qk_logit(os.environ["K3_TEST_QK_NONFINITE"])
    if os.environ.get("K3_TEST_READONLY"):
        _read_only(os.environ["K3_TEST_READONLY"])
    if os.environ.get("K3_TEST_FSIZE"):
        _file_size_limit(int(os.environ["K3_TEST_FSIZE"]))
    if os.environ.get("K3_TEST_THREADS"):
        import torch

        torch.set_num_threads(int(os.environ["K3_TEST_THREADS"]))
    from k3_trainer.cli import main as k3_train

    return k3_train(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
