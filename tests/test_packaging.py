"""Packaging: the wheels and sdists work when installed outside the workspace.

Editable installs inside the workspace hide packaging mistakes, so these tests build every
package the way a release does (``scripts/build_all.py``: sdist, then the wheel from the
unpacked sdist) into a temporary ``dist/`` and look at what a user would get.

``test_every_artifact_is_complete`` runs ``scripts/check_dists.py`` on the build. It fails
on a module or data file the wheel leaves out (e.g. one matched by a ``.gitignore``
pattern, which hatchling honours), a missing ``py.typed`` or LICENSE, a README that is
not the long description, metadata that lost ``Requires-Python``, the license or the
classifiers, a sibling requirement that is not an exact pin, a sibling imported anywhere
in a package (even inside a function) but not declared, an entry point whose module or
function is not in the wheel, and an sdist missing a source file.
The ``test_the_checks_catch_*`` tests feed it deliberately broken artifacts, one per
mistake (doctored copies of the built wheels and sdists, and a source tree with a data
file the wheel lacks), and require each to be reported.

``test_wheels_install_and_work_outside_the_workspace`` uses one clean virtual
environment and a working directory outside the repository; what each step catches:

1. ``torch`` (``torch{K3_TORCH_SPEC}``, default ``==2.13.0``) from the usual index.
2. ``pip install --no-index --find-links DIST k3-optim`` with pip's configuration
   switched off: k3-optim must install from the build alone, next to torch only.
3. A smoke script trains a two-layer MLP with ``MuonAdamW`` for 20 steps and requires
   the loss to halve, with ``k3_optim`` imported from site-packages, its ``py.typed``
   installed, its version the workspace's, and no other ``k3_*`` module importable.
   Catches an undeclared sibling import or dependency of k3-optim (ModuleNotFoundError),
   a module missing from its wheel, a missing ``py.typed``, and a broken optimizer.
   The same script run against a copy of the wheel that imports ``k3_qkclip`` must fail:
   the negative case, proved on every run.
4. ``numpy``, ``tqdm``, ``tokenizers``, ``xxhash``, ``safetensors`` and ``lazy_loader``
   from the usual index, then ``pip install --no-index --find-links DIST k3-trainer``:
   the four siblings must come from DIST
   at exactly the pinned version. Catches a pin that DIST cannot satisfy (a sibling not
   built, a pin on another version). A new third-party dependency also stops it here:
   install it with numpy and tqdm.
5. Every ``k3_*`` package imports from the venv's site-packages (not the source tree),
   is not an editable install, has ``py.typed`` and reports the workspace version.
6. ``k3-train --help``: the console script exists and its entry point resolves; as the
   command imports the whole runner, a sibling the trainer imports but does not declare
   fails here too (a trainer built without its ``k3-model`` pin: "No module named
   'k3_model'").
7. ``k3-train prepare --out data``: the built-in corpus (Python's own ``pydoc_data``;
   no data file ships) tokenizes from an installed trainer; a data file the trainer
   needed but the wheel lacked would fail here.
8. ``k3-train train`` for 5 steps and ``k3-train inspect``: every module the run imports
   (lazily too) is installed; it writes a checkpoint, metrics and the package versions.

About 1–2 minutes on 2 CPU cores, most of it installing torch. Needs hatchling (the
``integration`` and dev environments have it) and the package index for torch, numpy,
tqdm, tokenizers, xxhash, safetensors and lazy_loader.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
BIN = "Scripts" if os.name == "nt" else "bin"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"k3_release_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


check_dists = _load_script("check_dists")
PACKAGES = {p.name: p for p in check_dists.workspace_packages(ROOT)}
VERSION = PACKAGES["k3-optim"].version


# One pytest-xdist worker runs this module, so its wheels and sdists are built once.
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("hatchling") is None:
        pytest.fail("hatchling is not installed: run the packaging tests in the integration "
                    "environment (hatch test -i package=integration) or pip install hatchling")
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "build_all.py"), "--out", str(out), "--no-check"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def test_every_artifact_is_complete(dist: Path) -> None:
    assert sorted(p.name for p in dist.iterdir()) == sorted(
        name for p in PACKAGES.values() for name in (p.wheel_name, p.sdist_name))
    assert check_dists.check_folder(dist, ROOT) == []


# --- deliberately broken artifacts ---------------------------------------------------

def _edit_wheel(wheel: Path, edit: Callable[[dict[str, bytes]], None]) -> None:
    with zipfile.ZipFile(wheel) as zf:
        files = {name: zf.read(name) for name in zf.namelist()}
    edit(files)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, content in files.items():
            zf.writestr(name, content)


def _edit_sdist(sdist: Path, edit: Callable[[dict[str, bytes]], None]) -> None:
    with tarfile.open(sdist) as tf:
        files = {m.name: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}
    edit(files)
    with tarfile.open(sdist, "w:gz") as tf:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tf.addfile(info, io.BytesIO(content))


def _dist_info(package: str) -> str:
    p = PACKAGES[package]
    return f"{p.stem}-{p.version}.dist-info"


def _import_undeclared_sibling(files: dict[str, bytes]) -> None:
    # k3-model declares k3-qkclip only; a lazy import of k3_optim is still a dependency.
    files["k3_model/model.py"] += b"\n\ndef _optimizer():\n    from k3_optim import MuonAdamW\n"


def _loosen_pin(files: dict[str, bytes]) -> None:
    key = f"{_dist_info('k3-model')}/METADATA"
    files[key] = files[key].replace(f"k3-qkclip=={VERSION}".encode(), b"k3-qkclip>=0.1")


def _break_entry_point(files: dict[str, bytes]) -> None:
    key = f"{_dist_info('k3-trainer')}/entry_points.txt"
    files[key] = files[key].replace(b"k3_trainer.cli:main", b"k3_trainer.cli:mian")


WHEEL_CASES = {
    "missing py.typed": ("k3-optim", lambda f: f.pop("k3_optim/py.typed"),
                         "k3_optim/py.typed is missing"),
    "missing module": ("k3-qkclip", lambda f: f.pop("k3_qkclip/observe.py"),
                       "k3_qkclip/observe.py is missing from the wheel"),
    "missing LICENSE": ("k3-checkpoint",
                        lambda f: f.pop(f"{_dist_info('k3-checkpoint')}/licenses/LICENSE"),
                        "licenses/LICENSE is missing"),
    "undeclared sibling import": ("k3-model", _import_undeclared_sibling,
                                  "imports the workspace sibling 'k3_optim'"),
    "sibling not pinned exactly": ("k3-model", _loosen_pin, "is not pinned =="),
    "entry point pointing nowhere": ("k3-trainer", _break_entry_point, "defines no 'mian'"),
    "a profile dump beside the modules": (
        "k3-model", lambda f: f.update({"k3_model/p2": b"\x00cProfile"}),
        "k3_model/p2 is neither a module, py.typed nor declared package data"),
}


@pytest.mark.parametrize("case", sorted(WHEEL_CASES))
def test_the_checks_catch_broken_wheels(dist: Path, tmp_path: Path, case: str) -> None:
    package, edit, expected = WHEEL_CASES[case]
    broken = tmp_path / "dist"
    shutil.copytree(dist, broken)
    _edit_wheel(broken / PACKAGES[package].wheel_name, edit)
    problems = check_dists.check_folder(broken, ROOT)
    assert any(expected in p for p in problems), problems


def test_the_checks_catch_an_sdist_missing_a_module(dist: Path, tmp_path: Path) -> None:
    broken = tmp_path / "dist"
    shutil.copytree(dist, broken)
    p = PACKAGES["k3-optim"]
    _edit_sdist(broken / p.sdist_name,
                lambda f: f.pop(f"{p.stem}-{p.version}/src/k3_optim/muon.py"))
    problems = check_dists.check_folder(broken, ROOT)
    assert problems == [f"{p.sdist_name}: src/k3_optim/muon.py is missing"]


def test_the_checks_catch_a_data_file_left_out_of_the_wheel(dist: Path,
                                                            tmp_path: Path) -> None:
    """A source tree holding a data file the built wheel lacks (e.g. a corpus recipe
    that a .gitignore pattern kept out of the build) is reported."""
    root = tmp_path / "workspace"
    root.mkdir()
    shutil.copy(ROOT / "LICENSE", root / "LICENSE")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")
    for package in PACKAGES.values():
        target = root / "packages" / package.folder.name
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(package.folder / name, target / name)
        shutil.copytree(package.folder / "src", target / "src", ignore=ignore)
    assert check_dists.check_folder(dist, root) == []  # the copy itself is faithful
    (root / "packages/k3-trainer/src/k3_trainer/corpus").mkdir()
    (root / "packages/k3-trainer/src/k3_trainer/corpus/recipe.toml").write_text("x = 1\n")
    problems = check_dists.check_folder(dist, root)  # undeclared: a stray file
    assert any("src/k3_trainer/corpus/recipe.toml is neither a module" in p
               for p in problems), problems
    pyproject = root / "packages/k3-trainer/pyproject.toml"
    pyproject.write_text(pyproject.read_text()
                         + '\n[tool.k3]\npackage-data = ["corpus/*.toml"]\n')
    problems = check_dists.check_folder(dist, root)  # declared: it must be in the wheel
    assert any("k3_trainer/corpus/recipe.toml is missing from the wheel" in p
               for p in problems), problems


# --- installing into a clean virtual environment -------------------------------------

SMOKE = '''\
"""k3-optim alone: train a two-layer MLP with MuonAdamW, no other k3_* importable."""
import importlib.metadata
import math
import pkgutil
import sys
import sysconfig
from pathlib import Path

import torch

import k3_optim
from k3_optim import MuonAdamW, build_parameter_groups

expected_version = sys.argv[1]
site = Path(sysconfig.get_paths()["purelib"]).resolve()
where = Path(k3_optim.__file__).resolve()
assert site in where.parents, f"k3_optim comes from {where}, not {site}"
assert (where.parent / "py.typed").is_file(), "k3_optim/py.typed is not installed"
assert importlib.metadata.version("k3-optim") == k3_optim.__version__ == expected_version
others = sorted(m.name for m in pkgutil.iter_modules()
                if m.name.startswith("k3_") and m.name != "k3_optim")
assert not others, f"only k3-optim should be installed, also found {others}"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
groups = build_parameter_groups(model)
assert {g["use_muon"] for g in groups} == {True, False}, groups
optimizer = MuonAdamW(groups, lr=0.02, weight_decay=0.0)
x = torch.randn(256, 16)
target = torch.tanh(x @ torch.randn(16, 4))
losses = []
for _ in range(20):
    loss = torch.nn.functional.mse_loss(model(x), target)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.5 * losses[0], losses
print(f"k3-optim {expected_version}: MLP loss {losses[0]:.3f} -> {losses[-1]:.3f}")
'''

INSTALLED = '''\
"""Every k3_* package is installed from a wheel into this venv, with py.typed."""
import importlib
import importlib.metadata as md
import json
import sys
import sysconfig
from pathlib import Path

site = Path(sysconfig.get_paths()["purelib"]).resolve()
report = {}
for dist_name in sys.argv[2:]:
    module = importlib.import_module(dist_name.replace("-", "_"))
    where = Path(module.__file__).resolve()
    assert site in where.parents, f"{dist_name} comes from {where}, not {site}"
    assert (where.parent / "py.typed").is_file(), f"{dist_name}: py.typed is not installed"
    direct = md.distribution(dist_name).read_text("direct_url.json")
    assert direct is None or "editable" not in direct, f"{dist_name} is an editable install"
    assert md.version(dist_name) == module.__version__ == sys.argv[1], dist_name
    report[dist_name] = str(where.parent)
print(json.dumps(report))
'''


def _run(args: list[str | Path], *, cwd: Path, env: dict[str, str],
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} exited {result.returncode}\n"
        f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}")
    return result


@pytest.mark.slow
def test_wheels_install_and_work_outside_the_workspace(dist: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    assert ROOT.resolve() not in outside.resolve().parents
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV",
                        "PYTHONSAFEPATH", "PYTHONNOUSERSITE"}}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["K3_TRAIN_CACHE"] = str(tmp_path / "cache")
    # Offline installs see nothing but DIST: no pip configuration, no PIP_* settings.
    offline = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    offline["PIP_CONFIG_FILE"] = os.devnull

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=outside, env=env)
    python = venv / BIN / "python"

    # 1. torch only, from the usual index / find-links.
    torch_spec = os.environ.get("K3_TORCH_SPEC", "==2.13.0")
    # Byte-compiled, pip's default: several processes below import torch, and where
    # PYTHONDONTWRITEBYTECODE is set (this project's machines) each would compile what it
    # imports again. The PIP_NO_COMPILE=1 this test used to set changed nothing: pip reads
    # that variable as compile=1.
    _run([python, "-m", "pip", "install", "--quiet", f"torch{torch_spec}"],
         cwd=outside, env=env)

    # 2. k3-optim alone, offline from DIST.
    _run([python, "-m", "pip", "install", "--no-index", "--find-links", dist, "k3-optim"],
         cwd=outside, env=offline)

    # 3. The smoke script, isolated (-I: no PYTHONPATH, no user site, no script dir).
    smoke = tmp_path / "smoke_k3_optim.py"
    smoke.write_text(SMOKE)
    out = _run([python, "-I", smoke, VERSION], cwd=outside, env=env).stdout
    assert f"k3-optim {VERSION}: MLP loss" in out

    # 3b. Negative: a k3-optim wheel that imports an undeclared sibling fails the smoke.
    broken = tmp_path / "broken-k3-optim"
    with zipfile.ZipFile(dist / PACKAGES["k3-optim"].wheel_name) as zf:
        zf.extractall(broken)
    optimizer_py = broken / "k3_optim" / "optimizer.py"
    optimizer_py.write_text(optimizer_py.read_text() + "\nimport k3_qkclip  # undeclared\n")
    result = subprocess.run([str(python), str(smoke), VERSION], cwd=outside,
                            env={**env, "PYTHONPATH": str(broken)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode != 0 and "No module named 'k3_qkclip'" in result.stderr, (
        result.stdout + result.stderr)

    # 4. The trainer, its siblings offline from DIST at the pinned version.
    _run([python, "-m", "pip", "install", "--quiet", "numpy>=1.24", "tqdm>=4.60",
          "tokenizers>=0.19", "xxhash>=3", "safetensors>=0.4", "lazy_loader>=0.4"],
         cwd=outside, env=env)
    install = _run([python, "-m", "pip", "install", "--no-index", "--find-links", dist,
                    "k3-trainer"], cwd=outside, env=offline).stdout
    for name in ("k3-qkclip", "k3-checkpoint", "k3-model", "k3-trainer"):
        assert re.search(rf"{name}-{re.escape(VERSION)}\b", install), install

    # 5. Every package comes from the venv's site-packages, with py.typed, not editable.
    installer = tmp_path / "installed.py"
    installer.write_text(INSTALLED)
    where = json.loads(_run([python, "-I", installer, VERSION, *PACKAGES],
                            cwd=outside, env=env).stdout)
    assert sorted(where) == sorted(PACKAGES)

    # 6–8. The k3-train command, from outside the repository.
    k3_train = venv / BIN / "k3-train"
    help_text = _run([k3_train, "--help"], cwd=outside, env=env).stdout
    assert "prepare" in help_text and "train" in help_text
    _run([k3_train, "prepare", "--out", "data"], cwd=outside, env=env)
    manifest = json.loads((outside / "data" / "manifest.json").read_text())
    assert manifest["source"]["builtin"] == "pydoc_data.topics"
    _run([k3_train, "train", "--run-dir", "run", "--data", "data", "--max-steps", "5",
          "--eval-batches", "2", "--log-interval", "1", "--device", "cpu"],
         cwd=outside, env=env)
    events = [json.loads(line) for line in
              (outside / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(e["step"] for e in events if e["event"] == "train") == 5
    record = json.loads((outside / "run" / "run.json").read_text())
    assert {name: record["sessions"][-1]["versions"][name] for name in PACKAGES} == dict.fromkeys(
        PACKAGES, VERSION)
    summary = _run([k3_train, "inspect", outside / "run" / "checkpoints" / "latest" / "k3.ckpt"],
                   cwd=outside, env=env).stdout
    assert "step=5" in summary
