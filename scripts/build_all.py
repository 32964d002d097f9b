"""Build a wheel and an sdist of every workspace package into one folder, then check them.

    hatch run release:build                 # → dist/
    python scripts/build_all.py --out DIR   # with hatchling importable

Each package's sdist is built first and its wheel is built *from the unpacked sdist*, as
pip does for a user who installs from source: a file the sdist leaves out then breaks the
wheel too. The artifacts are staged in a temporary folder and moved into ``--out`` only
when every package has built; older ``k3_*`` artifacts there are removed first, so the
folder holds exactly one version. Then ``scripts/check_dists.py`` checks them
(``--no-check`` skips that).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_dists import ROOT, Package, check_folder, workspace_packages


def _hatchling(args: list[str], cwd: Path, python: str) -> None:
    result = subprocess.run([python, "-m", "hatchling", "build", *args], cwd=cwd,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"build_all: hatchling failed in {cwd}:\n{result.stdout}"
                         f"{result.stderr}")


def _extract(sdist: Path, into: Path) -> None:
    with tarfile.open(sdist) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(into, filter="data")
        else:  # pragma: no cover - Python without the extraction filters
            tf.extractall(into)  # our own freshly built sdist


def check_license_copies(root: Path, packages: list[Package]) -> list[str]:
    """Each package folder carries a copy of the root LICENSE (a build sees one folder)."""
    text = (root / "LICENSE").read_bytes()
    return [f"{p.folder / 'LICENSE'} is missing or differs from {root / 'LICENSE'}: "
            f"copy it (cp LICENSE {p.folder.relative_to(root)}/)"
            for p in packages
            if not (p.folder / "LICENSE").is_file() or (p.folder / "LICENSE").read_bytes() != text]


def build_all(out: Path, root: Path = ROOT, python: str = sys.executable) -> list[Path]:
    """Build every package into ``out``; returns the artifacts' paths."""
    packages = workspace_packages(root)
    problems = check_license_copies(root, packages)
    if problems:
        raise SystemExit("build_all: " + "\n".join(problems))
    with tempfile.TemporaryDirectory(prefix="k3-build-") as tmp:
        staging = Path(tmp) / "dist"
        for package in packages:
            _hatchling(["-t", "sdist", "-d", str(staging)], package.folder, python)
            sdist = staging / package.sdist_name
            if not sdist.is_file():
                raise SystemExit(f"build_all: hatchling built no {sdist.name}")
            unpacked = Path(tmp) / "unpacked"
            _extract(sdist, unpacked)
            base = unpacked / sdist.name.removesuffix(".tar.gz")
            _hatchling(["-t", "wheel", "-d", str(staging)], base, python)
            if not (staging / package.wheel_name).is_file():
                raise SystemExit(f"build_all: hatchling built no {package.wheel_name}")
            print(f"build_all: {package.sdist_name}, {package.wheel_name}")
        out.mkdir(parents=True, exist_ok=True)
        stems = tuple(f"{p.stem}-" for p in packages)
        for old in out.iterdir():
            if old.name.startswith(stems) and old.name.endswith((".whl", ".tar.gz")):
                old.unlink()
        built = []
        for artifact in sorted(staging.iterdir()):
            built.append(Path(shutil.move(str(artifact), out / artifact.name)))
    return built


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist",
                        help="folder for the wheels and sdists (default: dist/)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip scripts/check_dists.py after building")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    built = build_all(out)
    print(f"build_all: {len(built)} artifacts in {out}")
    if args.no_check:
        return 0
    problems = check_folder(out)
    for problem in problems:
        print(f"check_dists: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
