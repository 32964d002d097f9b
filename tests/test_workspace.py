"""The workspace stays coherent: one version, exact sibling pins, every package tested (and
`hatch test` keeping each suite's folder), no private torch API beyond a listed few."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _sibling_requirements(project: dict) -> list[str]:
    names = {_project(p / "pyproject.toml")["name"] for p in PACKAGES}
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    return [r for r in reqs if re.split(r"[\s<>=!~;\[@]", r, maxsplit=1)[0] in names]


def test_there_are_packages():
    assert PACKAGES, "no packages/*/pyproject.toml found"


def test_every_package_shares_the_workspace_version():
    expected = _project(ROOT / "pyproject.toml")["version"]
    versions = {p.name: _project(p / "pyproject.toml")["version"] for p in PACKAGES}
    assert versions == dict.fromkeys(versions, expected)


def test_siblings_are_pinned_exactly_to_that_version():
    expected = _project(ROOT / "pyproject.toml")["version"]
    for package in PACKAGES:
        for req in _sibling_requirements(_project(package / "pyproject.toml")):
            assert re.fullmatch(rf"[\w-]+(\[[\w,-]+\])?\s*=={re.escape(expected)}", req), (
                f"{package.name}: sibling requirement {req!r} must be pinned =={expected}"
            )


def test_installed_metadata_matches_the_source_tree():
    for package in PACKAGES:
        project = _project(package / "pyproject.toml")
        try:
            installed = version(project["name"])
        except PackageNotFoundError:
            continue  # only the packages of this environment are installed
        assert installed == project["version"], project["name"]


def test_every_package_is_in_the_root_test_matrix():
    hatch = tomllib.loads((ROOT / "hatch.toml").read_text())
    test_env = hatch["envs"]["hatch-test"]
    matrix = {value for entry in test_env["matrix"] for value in entry["package"]}
    overrides = test_env["overrides"]["matrix"]["package"]
    members = {o["value"] for o in overrides["workspace"]["members"]}
    for package in PACKAGES:
        assert package.name in matrix, f"add {package.name} to the hatch-test matrix"
        assert f"packages/{package.name}" in members
        assert (package / "README.md").is_file() and (package / "tests").is_dir()
        src = package / "src" / _project(package / "pyproject.toml")["name"].replace("-", "_")
        assert (src / "py.typed").is_file(), f"{package.name} lacks py.typed"


def _hatch_expand(command: str, env: dict[str, str], args: str) -> str:
    """hatch's context formatting of a script line: ``{env:NAME}``, ``{env:NAME:default}``,
    ``{args}`` and ``{args:default}`` (the default only where no arguments are given)."""
    command = re.sub(r"\{env:(\w+)(?::([^}]*))?\}",
                     lambda m: env.get(m.group(1), m.group(2) or ""), command)
    return re.sub(r"\{args(?::((?:[^{}]|\{[^{}]*\})*))?\}",
                  lambda m: args or (m.group(1) or ""), command)


@pytest.mark.parametrize("script", ["run", "run-cov"])  # `hatch test`, `hatch test --cover`
def test_options_given_to_hatch_test_keep_the_suites_folder(script):
    """``hatch test -i package=k3-qkclip -- -x`` runs k3-qkclip's tests, not pytest's
    collection of the whole workspace in an environment that lacks most of it."""
    hatch = tomllib.loads((ROOT / "hatch.toml").read_text())
    test_env = hatch["envs"]["hatch-test"]
    env = {o["key"]: o["value"] for o in test_env["overrides"]["matrix"]["package"]["env-vars"]
           if o["if"] == ["k3-qkclip"]}
    pytest_line = test_env["scripts"][script][-1]
    command = shlex.split(_hatch_expand(pytest_line, env, "-p no:randomly -n 0 --co -q"))
    command = command[command.index("pytest"):]  # run-cov's runs under `coverage run -m`
    done = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith(env["K3_TESTS"] + "/") for line in collected)


# Private torch names a package may still use, each with why (no public equivalent). The
# test below fails on any other, and on an entry here that is no longer used.
PRIVATE_TORCH_ALLOWED = {
    # torch.optim's own optimizers run on these; torch has no public foreach API
    ("k3-optim", "torch._foreach_"),
    # dynamo's compile callbacks, torch's only compile-event hook; guarded (compiling.py)
    ("k3-trainer", "torch._dynamo"),
}


def test_no_package_names_a_private_torch_api_beyond_the_listed_ones():
    """A private torch name can vanish in any release without notice."""
    private = re.compile(r"torch(?:\.\w+)*\._[A-Za-z]\w*")  # torch._C, torch.x._y, ...
    found: set[tuple[str, str]] = set()
    unlisted = []
    for package in PACKAGES:
        for file in sorted((package / "src").rglob("*.py")):
            for number, line in enumerate(file.read_text().splitlines(), 1):
                for name in private.findall(line):
                    allowed = [prefix for owner, prefix in PRIVATE_TORCH_ALLOWED
                               if owner == package.name and name.startswith(prefix)]
                    found.update((package.name, prefix) for prefix in allowed)
                    if not allowed:
                        unlisted.append(f"{file.relative_to(ROOT)}:{number}: {name}")
    assert unlisted == []
    assert found == PRIVATE_TORCH_ALLOWED, "drop the entries no longer used"
