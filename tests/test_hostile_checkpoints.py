"""Guarantee 3: a damaged, forged, malicious or foreign checkpoint is refused by
``k3-train train --resume`` in one line (exit status 2, no traceback, the run directory
untouched), and by the library without changing the model, optimizer, loader cursors or
any RNG.

Each hostile file replaces the latest checkpoint file (``checkpoints/latest/k3.ckpt``) of a
copy of a healthy run at step 2. The
forged ones carry a valid trailer and checksum (see ``harness.forge``), so they reach the
checks behind the integrity layer; the ``intact`` case forges the healthy payload
unchanged and must resume, which shows that every refusal comes from the damage.
"""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness import (
    NARROW_TINY_OVERRIDES,
    Evil,
    assert_one_line_error,
    forge,
    k3_train,
    latest_checkpoint,
    moved,
    state_fingerprint,
    toml_text,
    tree_bytes,
)

from k3_checkpoint import CheckpointError, read_payload
from k3_model import K3Config
from k3_trainer import TrainConfig, Trainer, prepare_dataset
from k3_trainer.cli import main


@dataclass
class Base:
    run: Path  # a healthy run at step 2
    foreign: dict[str, Path]  # checkpoints of runs that differ in one respect
    marker: Path  # what a malicious pickle would create
    data_dir: Path


def _run(run_dir, data_dir, config, *extra) -> None:
    code = main(["train", "--run-dir", str(run_dir), "--data", str(data_dir), "--config",
                 str(config), "--max-steps", "2", "--checkpoint-interval", "1",
                 "--warmup-steps", "1", "--decay-steps", "6", *map(str, extra)])
    assert code == 0


@pytest.fixture(scope="module")
def base(tmp_path_factory, data_dir, small_toml) -> Base:
    root = tmp_path_factory.mktemp("hostile")
    _run(root / "base", data_dir, small_toml)
    foreign = {}
    for name, model in (("model-config", {"moe_top_k": 1}), ("vocab", {"vocab_size": 512})):
        config = root / f"{name}.toml"
        config.write_text(toml_text(model={**NARROW_TINY_OVERRIDES, **model}))
        _run(root / name, data_dir, config)
        foreign[name] = latest_checkpoint(root / name)
    text = root / "other.txt"
    text.write_text("A different corpus, so a different manifest. " * 800)
    prepare_dataset([text], root / "other-data")
    _run(root / "data-manifest", root / "other-data", small_toml)
    foreign["data-manifest"] = latest_checkpoint(root / "data-manifest")
    return Base(root / "base", foreign, root / "pwned", data_dir)


# -- the hostile files ---------------------------------------------------------------------


def _truncated(base: Base, path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bit_flipped(base: Base, path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _historical(version: int, enveloped: bool):
    def make(base: Base, path: Path) -> None:
        payload = read_payload(path)
        payload["format_version"] = version
        if enveloped:
            forge(path, payload, format_version=version)
        else:  # what an earlier trainer wrote: a plain torch.save
            torch.save(payload, path)
    return make


def _raw_pickle(base: Base, path: Path) -> None:
    path.write_bytes(pickle.dumps({"format_version": 7, "model": Evil(base.marker)}))


def _pickle_in_torch_zip(base: Base, path: Path) -> None:
    torch.save({"format_version": 7, "model": Evil(base.marker)}, path)


def _pickle_behind_valid_trailer(base: Base, path: Path) -> None:
    payload = read_payload(path)
    payload["counters"] = Evil(base.marker)
    forge(path, payload)


def _foreign(name: str):
    def make(base: Base, path: Path) -> None:
        shutil.copy(base.foreign[name], path)
    return make


def _doctored(change):
    def make(base: Base, path: Path) -> None:
        payload = read_payload(path)
        change(payload)
        forge(path, payload)
    return make


def _layout(payload: dict) -> None:
    # One per-head Muon matrix in the plain Muon group instead (an optimizer that groups
    # differently): same parameters, same shapes, another layout.
    entry = next(e for e in payload["optimizer_layout"] if e["name"].endswith("q_proj.weight"))
    entry["group"] = 0


def _geometry(payload: dict) -> None:
    module = next(iter(payload["qk_clip"]["geometry"]["modules"].values()))
    key = next(k for k, v in module.items() if isinstance(v, int) and not isinstance(v, bool))
    module[key] += 1


def _optimizer_type(payload: dict) -> None:
    payload["optimizer_type"] = "torch.optim.adamw.AdamW"


def _train_config(payload: dict) -> None:
    payload["train_config"]["peak_lr"] *= 2


def _negative_counter(payload: dict) -> None:
    payload["counters"]["tokens_seen"] = -1


def _loader_past_end(payload: dict) -> None:
    payload["loaders"]["train"]["offset"] = 10**12


def _loaders_swapped(payload: dict) -> None:
    loaders = payload["loaders"]
    loaders["train"], loaders["val"] = loaders["val"], loaders["train"]


# name: (make the hostile file, what the one-line reason must contain)
CASES = {
    "intact": (_doctored(lambda payload: None), None),
    "truncated": (_truncated, "truncated"),
    "bit-flipped": (_bit_flipped, "checksum mismatch"),
    "zero-length": (lambda base, path: path.write_bytes(b""), "is empty"),
    **{f"format-{v}": (_historical(v, True), f"historical recipe format {v} is not supported")
       for v in (3, 4, 5, 6)},
    **{f"format-{v}-bare": (_historical(v, False),
                            f"historical recipe format {v} is not supported")
       for v in (3, 4, 5, 6)},
    "format-8": (_historical(8, True), "unknown checkpoint format 8"),
    "format-8-bare": (_historical(8, False), "unknown checkpoint format 8"),
    "malicious-raw-pickle": (_raw_pickle, "is not a k3 checkpoint"),
    "malicious-torch-zip": (_pickle_in_torch_zip, "weights_only"),
    "malicious-behind-valid-trailer": (_pickle_behind_valid_trailer, "weights_only"),
    "other-model-config": (_foreign("model-config"), "incompatible model_config"),
    "other-vocab": (_foreign("vocab"), "incompatible vocab_size — vocab_size: checkpoint 512"),
    "other-data-manifest": (_foreign("data-manifest"),
                            "loaders.train refused its saved state (DataMismatch: loader state "
                            "belongs to different data"),
    "other-optimizer-layout": (_doctored(_layout), "incompatible optimizer_layout"),
    "other-optimizer-type": (_doctored(_optimizer_type), "incompatible optimizer_type"),
    "other-qk-clip-geometry": (_doctored(_geometry), "incompatible qk_clip"),
    "other-train-config": (_doctored(_train_config), "train_config.peak_lr"),
    "negative-counter": (_doctored(_negative_counter), "tokens_seen=-1"),
    "no-counters": (_doctored(lambda p: p.pop("counters")),
                    "counters.step in the checkpoint is <missing>"),
    "counters-not-a-mapping": (_doctored(lambda p: p.update(counters="step=2")),
                               "counters.step in the checkpoint is <missing>"),
    "counter-missing": (_doctored(lambda p: p["counters"].pop("tokens_seen")),
                        "counters lack ['tokens_seen']"),
    "loaders-swapped": (_doctored(_loaders_swapped),
                        "loaders.train refused its saved state (DataError: loader state "
                        "belongs to split 'val'"),
    "loader-past-its-data": (_doctored(_loader_past_end), "loader offset 1000000000000 is "
                                                           "outside split 'train'"),
}


def _hostile_run(base: Base, tmp_path: Path, case: str) -> Path:
    run = tmp_path / case
    shutil.copytree(base.run, run, symlinks=True)
    CASES[case][0](base, latest_checkpoint(run))
    return run


@pytest.mark.parametrize("case", list(CASES))
def test_cli_resume_refuses_in_one_line_and_touches_nothing(base, tmp_path, case, capsys):
    run = _hostile_run(base, tmp_path, case)
    before = tree_bytes(run)
    capsys.readouterr()
    code = main(["train", "--run-dir", str(run), "--resume", "--max-steps", "4"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert not base.marker.exists(), "a pickle ran code"
    match = CASES[case][1]
    if match is None:
        assert code == 0 and read_payload(latest_checkpoint(run))["counters"]["step"] == 4
        return
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("k3-train: error:") and match in err[0], err
    assert tree_bytes(run) == before, "a refused resume wrote into the run directory"


@pytest.mark.parametrize("case", list(CASES))
def test_library_load_refuses_without_mutation(base, tmp_path, case):
    run = _hostile_run(base, tmp_path, case)
    saved = read_payload(latest_checkpoint(base.run))
    config = TrainConfig.from_dict({**saved["train_config"], "max_steps": 4})
    live = moved(config, base.data_dir, K3Config.from_dict(saved["model_config"]))
    model, optimizer, train_loader, val_loader = live
    before = state_fingerprint(model, optimizer, [train_loader, val_loader])
    match = CASES[case][1]
    if match is None:
        trainer = Trainer(model, optimizer, (train_loader, val_loader), config)
        trainer.resume(latest_checkpoint(run))
        assert trainer.state.step == 2
        assert state_fingerprint(model, optimizer, [train_loader, val_loader]) != before
        return
    with pytest.raises(CheckpointError) as refused:
        Trainer(model, optimizer, (train_loader, val_loader), config).resume(
            latest_checkpoint(run))
    assert match in str(refused.value) and "\n" not in str(refused.value)
    assert not base.marker.exists(), "a pickle ran code"
    assert state_fingerprint(model, optimizer, [train_loader, val_loader]) == before


def test_a_different_thread_count_is_refused(base, tmp_path):
    """The runtime signature records torch's intra-op thread count (it changes CPU
    reduction order, so bitwise continuation needs the same one)."""
    run = tmp_path / "threads"
    shutil.copytree(base.run, run, symlinks=True)
    before = tree_bytes(run)
    threads = torch.get_num_threads()  # what the healthy run was saved under
    # OMP_NUM_THREADS, as a user would change it (torch caps it at the core count, so go
    # down when possible), and torch.set_num_threads in the new process (never capped).
    other = 1 if threads > 1 else 2
    variants = [({"K3_TEST_THREADS": str(threads + 1)}, threads + 1)]
    if other < threads or (os.cpu_count() or 1) > 1:
        variants.append(({"OMP_NUM_THREADS": str(other), "MKL_NUM_THREADS": str(other)},
                         other))
    for env, current in variants:
        resumed = k3_train("train", "--run-dir", run, "--resume", "--max-steps", 4,
                           driver=True, env=env)
        assert_one_line_error(resumed, f"runtime.num_threads: checkpoint {threads}, "
                                       f"current {current}", code=2)
        assert tree_bytes(run) == before

    saved = read_payload(latest_checkpoint(run))
    config = TrainConfig.from_dict({**saved["train_config"], "max_steps": 4})
    model, optimizer, train_loader, val_loader = moved(
        config, base.data_dir, K3Config.from_dict(saved["model_config"]))
    before_fp = state_fingerprint(model, optimizer, [train_loader, val_loader])
    torch.set_num_threads(threads + 1)
    try:
        with pytest.raises(CheckpointError, match=r"runtime\.num_threads"):
            Trainer(model, optimizer, (train_loader, val_loader), config).resume(
                latest_checkpoint(run))
    finally:
        torch.set_num_threads(threads)
    assert state_fingerprint(model, optimizer, [train_loader, val_loader]) == before_fp


def test_the_real_command_refuses_a_corrupt_checkpoint_without_traceback(base, tmp_path):
    """The same path end to end in a new process: stderr is exactly one line."""
    run = _hostile_run(base, tmp_path, "bit-flipped")
    before = tree_bytes(run)
    resumed = k3_train("train", "--run-dir", run, "--resume", "--max-steps", 4)
    assert_one_line_error(resumed, "checksum mismatch", code=2)
    assert tree_bytes(run) == before
    inspect = k3_train("inspect", latest_checkpoint(run))
    assert_one_line_error(inspect, "checksum mismatch", code=2)
