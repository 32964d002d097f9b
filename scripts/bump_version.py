"""Bump the shared version: the root pyproject, every package, every exact sibling pin.

    hatch run release:bump 0.2.0
    python scripts/bump_version.py 0.2.0 [--root DIR] [--dry-run] [--no-changelog] [--date D]

The new version must be a canonical public PEP 440 version (``1.2.0``, ``1.2.0rc1``,
``1.2.0.post1``; no ``v`` prefix, no ``+local`` part) greater than the current one, and
the workspace must be coherent before the bump (one version, siblings pinned exactly to
it), as ``tests/test_workspace.py`` requires after it.

CHANGELOG.md: the ``## [Unreleased]`` section becomes ``## [X] - DATE`` and a new empty
``## [Unreleased]`` goes above it. A bump with nothing recorded there is refused (write
the user-visible changes first), unless the changelog already has a ``## [X]`` section or
``--no-changelog`` is given.

Only the ``version = "..."`` line of each ``[project]`` table and the quoted sibling pins
are rewritten, so comments and layout stay. Every new file is computed and re-parsed
(the parsed result must equal the old one with just those changes) before anything is
written; each file is then replaced atomically, and if a write fails the files already
replaced are restored.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
UNRELEASED = re.compile(r"^## \[Unreleased\][^\n]*\n", re.MULTILINE)


class BumpError(Exception):
    """The bump cannot be done; nothing was written."""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _normalize(re.split(r"[\s<>=!~;\[@(]", req.strip(), maxsplit=1)[0])


def parse_new_version(text: str, current: str) -> str:
    try:
        version = Version(text)
    except InvalidVersion:
        raise BumpError(f"{text!r} is not a PEP 440 version (e.g. 0.2.0, 1.0.0rc1)") from None
    if str(version) != text:
        raise BumpError(f"{text!r} is not in canonical form: use {str(version)!r}")
    if version.local is not None:
        raise BumpError(f"{text!r} has a local part (+...), which package indexes refuse")
    if version <= Version(current):
        raise BumpError(f"{text} is not greater than the current version {current}")
    return text


def _project_table_span(text: str, path: Path) -> tuple[int, int]:
    """Start and end offsets of the ``[project]`` table's body."""
    header = re.search(r"^\[project\][ \t]*(#.*)?$", text, re.MULTILINE)
    if header is None:
        raise BumpError(f"{path}: no [project] table")
    following = re.compile(r"^\[", re.MULTILINE).search(text, header.end())
    return header.end(), following.start() if following else len(text)


def _set_version(text: str, old: str, new: str, path: Path) -> str:
    start, end = _project_table_span(text, path)
    body, count = re.subn(rf'^(version[ \t]*=[ \t]*)"{re.escape(old)}"', rf'\g<1>"{new}"',
                          text[start:end], flags=re.MULTILINE)
    if count != 1:
        raise BumpError(f'{path}: expected one version = "{old}" line in [project]')
    return text[:start] + body + text[end:]


def _set_pins(text: str, names: set[str], old: str, new: str) -> str:
    """Rewrite every quoted requirement ``"<sibling>[extras]==old[; marker]"``."""
    def replace(match: re.Match[str]) -> str:
        if _normalize(match["name"]) not in names:
            return match[0]
        return f'"{match["name"]}{match["extras"] or ""}{match["op"]}{new}{match["rest"]}"'

    pattern = (r'"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[^\]"]*\])?'
               rf'(?P<op>\s*==\s*){re.escape(old)}(?P<rest>\s*(;[^"]*)?)"')
    return re.sub(pattern, replace, text)


def _expected(data: dict[str, Any], names: set[str], old: str, new: str) -> dict[str, Any]:
    """What the parsed file must be after the bump: the old one with only these changes."""
    data = copy.deepcopy(data)
    project = data["project"]
    project["version"] = new
    lists = [project.get("dependencies", []),
             *project.get("optional-dependencies", {}).values()]
    for reqs in lists:
        for i, req in enumerate(reqs):
            if _requirement_name(req) in names:
                reqs[i] = re.sub(rf"==\s*{re.escape(old)}", f"=={new}", req)
    return data


def _check_coherent(files: dict[Path, dict[str, Any]], names: set[str], current: str) -> None:
    for path, data in files.items():
        project = data["project"]
        if project.get("version") != current:
            raise BumpError(f"{path}: version {project.get('version')!r} differs from the "
                            f"root's {current!r}; fix the drift before bumping")
        reqs = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            reqs.extend(extra)
        for req in reqs:
            if _requirement_name(req) in names and not re.fullmatch(
                    rf"[\w.-]+(\[[\w,\s.-]+\])?\s*==\s*{re.escape(current)}\s*(;.*)?", req):
                raise BumpError(f"{path}: sibling requirement {req!r} is not pinned "
                                f"=={current}; fix it before bumping")


def _changelog(text: str, new: str, date: str, path: Path) -> str | None:
    """The new CHANGELOG text, or None when it already has a section for ``new``."""
    if re.search(rf"^## \[{re.escape(new)}\]", text, re.MULTILINE):
        return None
    match = UNRELEASED.search(text)
    if match is None:
        raise BumpError(f"{path}: no '## [Unreleased]' section to release as {new}")
    following = re.compile(r"^## ", re.MULTILINE).search(text, match.end())
    body = text[match.end():following.start() if following else len(text)]
    if not re.search(r"\S", body):
        raise BumpError(f"{path}: nothing recorded under '## [Unreleased]'; write the "
                        f"user-visible changes of {new} there first (or --no-changelog)")
    return text[:match.start()] + f"## [Unreleased]\n\n## [{new}] - {date}\n" + \
        text[match.end():]


def plan_bump(root: Path, new: str, *, changelog: bool = True,
              date: str | None = None) -> tuple[str, dict[Path, str]]:
    """Validate and compute the bump: (old version, {path: new text}). Writes nothing."""
    root_file = root / "pyproject.toml"
    package_files = sorted((root / "packages").glob("*/pyproject.toml"))
    if not package_files:
        raise BumpError(f"no packages/*/pyproject.toml under {root}")
    texts = {path: path.read_text() for path in [root_file, *package_files]}
    parsed = {path: tomllib.loads(text) for path, text in texts.items()}
    current = parsed[root_file]["project"]["version"]
    names = {_normalize(parsed[p]["project"]["name"]) for p in package_files}
    _check_coherent(parsed, names, current)
    parse_new_version(new, current)

    changes: dict[Path, str] = {}
    for path, text in texts.items():
        updated = _set_pins(_set_version(text, current, new, path), names, current, new)
        if tomllib.loads(updated) != _expected(parsed[path], names, current, new):
            raise BumpError(f"{path}: the rewritten file does not parse to the expected "
                            "content; bump it by hand")
        changes[path] = updated
    if changelog:
        log = root / "CHANGELOG.md"
        if not log.is_file():
            raise BumpError(f"{log} not found (or pass --no-changelog)")
        updated_log = _changelog(log.read_text(), new,
                                 date or datetime.date.today().isoformat(), log)
        if updated_log is not None:
            changes[log] = updated_log
    return current, changes


def _replace(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_changes(changes: dict[Path, str]) -> None:
    originals = {path: path.read_text() for path in changes}
    done: list[Path] = []
    try:
        for path, text in changes.items():
            _replace(path, text)
            done.append(path)
    except BaseException:
        for path in done:
            _replace(path, originals[path])
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the new version, e.g. 0.2.0")
    parser.add_argument("--root", type=Path, default=ROOT, help="workspace root")
    parser.add_argument("--dry-run", action="store_true", help="show what would change")
    parser.add_argument("--no-changelog", action="store_true",
                        help="do not require or edit a CHANGELOG.md entry")
    parser.add_argument("--date", help="release date for the changelog (default: today)")
    args = parser.parse_args(argv)
    try:
        old, changes = plan_bump(args.root.resolve(), args.version,
                                 changelog=not args.no_changelog, date=args.date)
        if not args.dry_run:
            write_changes(changes)
    except (BumpError, OSError) as exc:
        print(f"bump_version: {exc}", file=sys.stderr)
        return 2
    verb = "would update" if args.dry_run else "updated"
    for path in changes:
        print(f"bump_version: {verb} {path}")
    print(f"bump_version: {old} -> {args.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
