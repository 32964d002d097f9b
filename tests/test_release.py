"""Release tooling: ``scripts/bump_version.py`` on a temporary copy of the workspace's
pyproject files (never the real ones), and the LICENSE copies every package build needs."""

from __future__ import annotations

import difflib
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"k3_release_{name}",
                                                  ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bump = _load_script("bump_version")
CURRENT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CHANGELOG = f"""# Changelog

## [Unreleased]

### k3-optim
- Something users will notice.

## [{CURRENT}] - 2026-11-30

First release.
"""


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _sibling_requirements(root: Path, project: dict) -> list[str]:
    names = {_project(p)["name"] for p in root.glob("packages/*/pyproject.toml")}
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    return [r for r in reqs if re.split(r"[\s<>=!~;\[@]", r, maxsplit=1)[0] in names]


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """The root and package pyproject files and a CHANGELOG, copied to a temporary root."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        target = tmp_path / "packages" / pyproject.parent.name
        target.mkdir(parents=True)
        shutil.copy(pyproject, target / "pyproject.toml")
    (tmp_path / "CHANGELOG.md").write_text(CHANGELOG)
    return tmp_path


def _snapshot(root: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _next(version: str) -> str:
    major, minor, *_ = (int(part) for part in re.findall(r"\d+", version))
    return f"{major}.{minor + 1}.0"


def test_bump_rewrites_every_version_and_pin_and_nothing_else(workspace: Path) -> None:
    new = _next(CURRENT)
    before = _snapshot(workspace)
    assert bump.main([new, "--root", str(workspace), "--date", "2027-01-15"]) == 0

    packages = sorted(workspace.glob("packages/*/pyproject.toml"))
    assert len(packages) == len(list(ROOT.glob("packages/*/pyproject.toml"))) >= 5
    assert _project(workspace / "pyproject.toml")["version"] == new
    pins = 0
    for path in packages:
        project = _project(path)
        assert project["version"] == new, path
        for req in _sibling_requirements(workspace, project):
            assert re.fullmatch(rf"[\w-]+(\[[\w,-]+\])?\s*=={re.escape(new)}", req), req
            pins += 1
    assert pins >= 5  # k3-model pins k3-qkclip; k3-trainer pins four siblings

    # Only version lines and pins changed; comments, layout and everything else stay.
    for path in [workspace / "pyproject.toml", *packages]:
        changed = [line for line in difflib.ndiff(before[path].splitlines(),
                                                  path.read_text().splitlines())
                   if line.startswith(("+ ", "- "))]
        removed = [line[2:] for line in changed if line.startswith("- ")]
        assert all(CURRENT in line for line in removed), removed
        assert [line.replace(CURRENT, new) for line in removed] == [
            line[2:] for line in changed if line.startswith("+ ")]

    log = (workspace / "CHANGELOG.md").read_text()
    assert log.startswith("# Changelog\n\n## [Unreleased]\n\n"
                          f"## [{new}] - 2027-01-15\n\n### k3-optim\n- Something")
    assert f"## [{CURRENT}] - 2026-11-30" in log


def test_dry_run_writes_nothing(workspace: Path) -> None:
    before = _snapshot(workspace)
    assert bump.main([_next(CURRENT), "--root", str(workspace), "--dry-run"]) == 0
    assert _snapshot(workspace) == before


@pytest.mark.parametrize("version", [
    "banana", "", "v9.0.0", "9.0.0-rc1", "9.0.0.dev", "9.0.0+local", CURRENT, "0.0.1",
])
def test_invalid_versions_are_refused_and_nothing_is_written(workspace: Path,
                                                             version: str) -> None:
    before = _snapshot(workspace)
    with pytest.raises(bump.BumpError):
        bump.plan_bump(workspace, version)
    assert bump.main([version, "--root", str(workspace)]) == 2
    assert _snapshot(workspace) == before


def test_a_drifted_workspace_is_refused(workspace: Path) -> None:
    model = workspace / "packages" / "k3-model" / "pyproject.toml"
    model.write_text(model.read_text().replace(f'"k3-qkclip=={CURRENT}"', '"k3-qkclip>=0.1"'))
    before = _snapshot(workspace)
    with pytest.raises(bump.BumpError, match="not pinned"):
        bump.plan_bump(workspace, _next(CURRENT))
    assert bump.main([_next(CURRENT), "--root", str(workspace)]) == 2
    assert _snapshot(workspace) == before


def test_an_empty_unreleased_section_is_refused(workspace: Path) -> None:
    log = workspace / "CHANGELOG.md"
    log.write_text(CHANGELOG.replace("### k3-optim\n- Something users will notice.\n", ""))
    before = _snapshot(workspace)
    with pytest.raises(bump.BumpError, match="nothing recorded"):
        bump.plan_bump(workspace, _next(CURRENT))
    assert _snapshot(workspace) == before
    # Explicitly without the changelog it goes through.
    assert bump.main([_next(CURRENT), "--root", str(workspace), "--no-changelog"]) == 0
    assert log.read_text() == before[log]


def test_a_failed_write_restores_the_files_already_replaced(workspace: Path,
                                                            monkeypatch) -> None:
    before = _snapshot(workspace)
    real_replace = bump._replace
    calls = {"n": 0}

    def flaky(path: Path, text: str) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real_replace(path, text)

    monkeypatch.setattr(bump, "_replace", flaky)
    assert bump.main([_next(CURRENT), "--root", str(workspace)]) == 2
    assert _snapshot(workspace) == before  # no temporary files left either


def test_the_real_workspace_is_bumpable_without_touching_it() -> None:
    files = [ROOT / "pyproject.toml", *ROOT.glob("packages/*/pyproject.toml")]
    before = {p: p.read_text() for p in files}
    old, changes = bump.plan_bump(ROOT, _next(CURRENT), changelog=False)
    assert old == CURRENT and set(changes) == set(files)
    assert {p: p.read_text() for p in files} == before


def test_every_package_ships_the_root_license() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    for pyproject in ROOT.glob("packages/*/pyproject.toml"):
        project = _project(pyproject)
        assert project["license"] == "Apache-2.0", pyproject
        assert project["license-files"] == ["LICENSE"], pyproject
        copy = pyproject.parent / "LICENSE"
        assert copy.is_file() and copy.read_text() == license_text, (
            f"{copy} must be a copy of the root LICENSE: cp LICENSE {pyproject.parent}/")


def test_the_changelog_has_an_entry_for_the_current_version() -> None:
    log = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in log
    assert re.search(rf"^## \[{re.escape(CURRENT)}\] - \d{{4}}-\d\d-\d\d$", log, re.MULTILINE)
    packages = [_project(p)["name"] for p in ROOT.glob("packages/*/pyproject.toml")]
    assert all(f"### {name}" in log for name in packages)
