"""Check the built wheels and sdists of every workspace package, without installing them.

    python scripts/check_dists.py [DIST]        # default: ./dist; exit 1 on any problem

Editable installs inside the workspace hide packaging mistakes; this looks at what a user
would download. Per package it requires exactly one wheel and one sdist of the workspace
version in DIST, and checks in the wheel:

- metadata: name, version, summary, ``Requires-Python``, ``License-Expression`` and
  ``License-File``, the classifiers of ``pyproject.toml``, the README as a Markdown long
  description, and every sibling requirement pinned exactly (``k3-qkclip==0.1.0``);
- files: every file of ``src/<import>/`` (modules, ``py.typed``, the package data its
  ``[tool.k3] package-data`` patterns declare) is in the wheel with the same bytes, the
  LICENSE is under ``.dist-info/licenses/``, and nothing else is; a file of any other
  kind, in the wheel or in the source tree (a profile dump, scratch output), is refused;
- imports: every absolute import in the wheel's modules is the standard library, the
  package itself, or a declared requirement (a sibling imported but not declared fails);
- entry points: ``entry_points.txt`` equals ``[project.scripts]`` and each target names a
  module in the wheel that defines the attribute;

and in the sdist: ``pyproject.toml``, ``README.md``, ``LICENSE``, ``PKG-INFO`` and every
source file. Used by ``scripts/build_all.py`` after a build and by
``tests/test_packaging.py``. Needs ``packaging`` (hatchling and pytest bring it).
"""

from __future__ import annotations

import argparse
import ast
import configparser
import email
import fnmatch
import re
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# Import names whose distribution is named differently (extend when a dependency needs it).
IMPORT_TO_DIST = {"yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn",
                  "fla": "flash-linear-attention"}


def normalize(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Package:
    """One workspace distribution, as its ``pyproject.toml`` describes it."""

    folder: Path
    project: dict[str, Any]
    import_name: str
    tool: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.project["name"])

    @property
    def version(self) -> str:
        return str(self.project["version"])

    @property
    def stem(self) -> str:
        """The file-name form of the distribution name (``k3_optim``)."""
        return normalize(self.name).replace("-", "_")

    @property
    def wheel_name(self) -> str:
        return f"{self.stem}-{self.version}-py3-none-any.whl"

    @property
    def sdist_name(self) -> str:
        return f"{self.stem}-{self.version}.tar.gz"

    def requirements(self) -> list[Requirement]:
        reqs = list(self.project.get("dependencies", []))
        for extra in self.project.get("optional-dependencies", {}).values():
            reqs.extend(extra)
        return [Requirement(r) for r in reqs]

    @property
    def package_data(self) -> list[str]:
        """Glob patterns (relative to the import package) of the data files it ships:
        ``[tool.k3] package-data`` in its ``pyproject.toml``."""
        return list(self.tool.get("k3", {}).get("package-data", []))

    def allowed(self, name: str) -> bool:
        """Whether ``<import>/<rel>`` may ship: a module or its stub, ``py.typed`` or
        declared data."""
        rel = name.split("/", 1)[1] if "/" in name else name
        return rel.endswith((".py", ".pyi")) or rel == "py.typed" or any(
            fnmatch.fnmatchcase(rel, pattern) for pattern in self.package_data)

    def _tree(self) -> dict[str, bytes]:
        src = self.folder / "src" / self.import_name
        files = {}
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            if not path.is_file() or any(part.startswith(".") for part in rel.parts):
                continue
            if "__pycache__" in rel.parts or path.suffix in {".pyc", ".pyo"}:
                continue
            files[f"{self.import_name}/{rel.as_posix()}"] = path.read_bytes()
        return files

    def source_files(self) -> dict[str, bytes]:
        """``<import>/<relative path>`` → bytes, for every file a wheel must carry."""
        return {name: data for name, data in self._tree().items() if self.allowed(name)}

    def stray_files(self) -> list[str]:
        """Files under ``src/<import>/`` that are neither modules, ``py.typed`` nor declared
        data (a profile dump, scratch output): they must not be there."""
        return [name for name in self._tree() if not self.allowed(name)]


def workspace_packages(root: Path = ROOT) -> list[Package]:
    packages = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        wheel = data.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {})
        declared = wheel.get("wheel", {}).get("packages", [])
        import_name = (PurePosixPath(declared[0]).name if declared
                       else normalize(project["name"]).replace("-", "_"))
        packages.append(Package(pyproject.parent, project, import_name, data.get("tool", {})))
    return packages


def _metadata(text: str) -> Message:
    return email.message_from_string(text)


def _top_level_imports(source: str, filename: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _top_level_names(source: str, filename: str) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(source, filename).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def check_wheel(package: Package, wheel: Path, packages: list[Package],
                license_text: bytes) -> list[str]:
    """Problems with one wheel (an empty list when it is fine)."""
    where = wheel.name
    problems: list[str] = []
    with zipfile.ZipFile(wheel) as zf:
        files = {name: zf.read(name) for name in zf.namelist() if not name.endswith("/")}
    dist_info = f"{package.stem}-{package.version}.dist-info"
    if f"{dist_info}/METADATA" not in files:
        return [f"{where}: no {dist_info}/METADATA"]
    meta = _metadata(files[f"{dist_info}/METADATA"].decode())
    project = package.project

    # Metadata.
    expected_fields = {
        "Name": package.name,
        "Version": package.version,
        "Summary": project.get("description"),
        "Requires-Python": project.get("requires-python"),
        "License-Expression": project.get("license"),
        "Description-Content-Type": "text/markdown",
    }
    for field, expected in expected_fields.items():
        if not expected:
            problems.append(f"{package.name}: pyproject.toml declares no value for {field}")
        elif meta.get(field) != expected:
            problems.append(f"{where}: {field} is {meta.get(field)!r}, expected {expected!r}")
    if "LICENSE" not in (meta.get_all("License-File") or []):
        problems.append(f"{where}: metadata names no License-File LICENSE")
    classifiers = sorted(meta.get_all("Classifier") or [])
    if not classifiers or classifiers != sorted(project.get("classifiers", [])):
        problems.append(f"{where}: classifiers {classifiers} differ from pyproject.toml's")
    readme = (package.folder / "README.md").read_text()
    body = meta.get_payload()
    if not isinstance(body, str) or body.strip() != readme.strip():
        problems.append(f"{where}: the long description is not {package.name}'s README.md")

    # Requirements: siblings pinned exactly, and the same siblings as pyproject.toml.
    siblings = {normalize(p.name): p for p in packages if p is not package}
    declared = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
    for req in declared:
        if normalize(req.name) in siblings and str(req.specifier) != f"=={package.version}":
            problems.append(f"{where}: sibling requirement {req} is not pinned "
                            f"=={package.version}")
    wanted = {normalize(r.name) for r in package.requirements() if normalize(r.name) in siblings}
    got = {normalize(r.name) for r in declared if normalize(r.name) in siblings}
    if wanted != got:
        problems.append(f"{where}: sibling requirements {sorted(got)} differ from "
                        f"pyproject.toml's {sorted(wanted)}")

    # Files: the source package exactly, plus the dist-info.
    source = package.source_files()
    for name, content in source.items():
        if name not in files:
            problems.append(f"{where}: {name} is missing from the wheel")
        elif files[name] != content:
            problems.append(f"{where}: {name} differs from the source tree (stale build?)")
    for name in package.stray_files():
        problems.append(f"{package.name}: src/{name} is neither a module, py.typed nor "
                        "declared package data ([tool.k3] package-data): remove it or "
                        "declare it")
    for name in files:
        if name.startswith(f"{dist_info}/"):
            continue
        if name.startswith(f"{package.import_name}/") and not package.allowed(name):
            problems.append(f"{where}: {name} is neither a module, py.typed nor declared "
                            "package data ([tool.k3] package-data)")
        elif name not in source:
            problems.append(f"{where}: unexpected file {name}")
    if f"{package.import_name}/py.typed" not in files:
        problems.append(f"{where}: {package.import_name}/py.typed is missing (PEP 561: "
                        "type checkers would ignore the package's annotations)")
    if files.get(f"{dist_info}/licenses/LICENSE") != license_text:
        problems.append(f"{where}: {dist_info}/licenses/LICENSE is missing or not the "
                        "workspace LICENSE")

    # Imports: standard library, the package itself, or a declared requirement.
    all_k3 = {p.import_name for p in packages}
    provided = {package.import_name}
    for req in declared:
        name = normalize(req.name)
        provided.add(siblings[name].import_name if name in siblings else name)
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name, content in sorted(files.items()):
        if not name.endswith(".py") or name.startswith(f"{dist_info}/"):
            continue
        for top in sorted(_top_level_imports(content.decode(), name) - stdlib):
            dist_form = normalize(IMPORT_TO_DIST.get(top, top))
            if top in provided or dist_form in provided:
                continue
            what = "workspace sibling" if top in all_k3 or top.startswith("k3_") else "module"
            problems.append(f"{where}: {name} imports the {what} {top!r}, which "
                            f"{package.name} does not declare as a dependency")

    # Entry points.
    scripts = dict(project.get("scripts", {}))
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    if f"{dist_info}/entry_points.txt" in files:
        parser.read_string(files[f"{dist_info}/entry_points.txt"].decode())
    found = dict(parser["console_scripts"]) if parser.has_section("console_scripts") else {}
    if found != scripts:
        problems.append(f"{where}: console scripts {found} differ from [project.scripts] "
                        f"{scripts}")
    for command, target in found.items():
        module, _, attr = target.partition(":")
        path = module.replace(".", "/")
        text = files.get(f"{path}.py") or files.get(f"{path}/__init__.py")
        if text is None:
            problems.append(f"{where}: entry point {command} = {target}: module {module} is "
                            "not in the wheel")
        elif attr.split(".")[0] not in _top_level_names(text.decode(), path):
            problems.append(f"{where}: entry point {command} = {target}: {module} defines "
                            f"no {attr.split('.')[0]!r}")

    wheel_meta = _metadata(files.get(f"{dist_info}/WHEEL", b"").decode())
    if wheel_meta.get("Root-Is-Purelib") != "true" or wheel_meta.get("Tag") != "py3-none-any":
        problems.append(f"{where}: not a pure-Python py3-none-any wheel")
    return problems


def check_sdist(package: Package, sdist: Path, license_text: bytes) -> list[str]:
    """Problems with one sdist (an empty list when it is fine)."""
    where = sdist.name
    base = f"{package.stem}-{package.version}"
    with tarfile.open(sdist) as tf:
        files = {}
        for member in tf.getmembers():
            if member.isfile():
                handle = tf.extractfile(member)
                files[member.name] = handle.read() if handle else b""
    problems = [f"{where}: {name} is outside {base}/" for name in files
                if not name.startswith(f"{base}/")]
    for name in ("pyproject.toml", "README.md", "LICENSE", "PKG-INFO"):
        if f"{base}/{name}" not in files:
            problems.append(f"{where}: {name} is missing")
    if f"{base}/LICENSE" in files and files[f"{base}/LICENSE"] != license_text:
        problems.append(f"{where}: LICENSE is not the workspace LICENSE")
    if f"{base}/PKG-INFO" in files:
        version = _metadata(files[f"{base}/PKG-INFO"].decode()).get("Version")
        if version != package.version:
            problems.append(f"{where}: PKG-INFO version {version!r} != {package.version!r}")
    for name in package.source_files():
        if f"{base}/src/{name}" not in files:
            problems.append(f"{where}: src/{name} is missing")
    return problems


def check_folder(dist: Path, root: Path = ROOT) -> list[str]:
    """Problems with the artifacts of every workspace package in ``dist``."""
    packages = workspace_packages(root)
    license_text = (root / "LICENSE").read_bytes()
    problems = []
    for package in packages:
        present = sorted(p.name for p in dist.glob(f"{package.stem}-*")
                         if p.name.endswith((".whl", ".tar.gz")))
        expected = [package.sdist_name, package.wheel_name]
        for name in present:
            if name not in expected:
                problems.append(f"{dist / name}: unexpected artifact (another version? "
                                "rebuild with scripts/build_all.py)")
        if package.wheel_name not in present:
            problems.append(f"{package.name}: no {package.wheel_name} in {dist}")
        else:
            problems += check_wheel(package, dist / package.wheel_name, packages, license_text)
        if package.sdist_name not in present:
            problems.append(f"{package.name}: no {package.sdist_name} in {dist}")
        else:
            problems += check_sdist(package, dist / package.sdist_name, license_text)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dist", nargs="?", type=Path, default=ROOT / "dist")
    args = parser.parse_args(argv)
    problems = check_folder(args.dist)
    for problem in problems:
        print(f"check_dists: {problem}", file=sys.stderr)
    if problems:
        return 1
    count = len(workspace_packages())
    print(f"check_dists: {count} wheels and {count} sdists in {args.dist} are complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
