"""Guarantee 4: hostile data and configuration get a clear one-line error (exit status 2,
no traceback) and nothing is written to the run directory that could be mistaken for
progress: a fresh run leaves no directory at all, a refused resume leaves every byte of
the run as it was.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import BASE_TRAIN, latest_checkpoint, toml_text, tree_bytes

from k3_checkpoint import read_payload
from k3_trainer import (
    ConfigError,
    DataError,
    PrepareOptions,
    TokenDataLoader,
    TrainConfig,
    prepare_dataset,
)
from k3_trainer.cli import main
from k3_trainer.config import choices
from k3_trainer.observe.metrics import read_events


def _cli(argv, capsys) -> tuple[int, list[str]]:
    """``main(argv)`` in process: the exit status and the non-empty stderr lines."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def _assert_refused(code, err, match) -> None:
    assert code == 2, (code, err)
    assert len(err) == 1 and err[0].startswith("k3-train") and " error: " in err[0], err
    assert match in err[0], (match, err[0])


def _writable_copy(data_dir: Path, to: Path) -> Path:
    shutil.copytree(data_dir, to)
    for file in to.iterdir():  # prepared shards are read-only (immutable)
        file.chmod(file.stat().st_mode | stat.S_IWUSR)
    return to


def _manifest(data: Path) -> dict:
    return json.loads((data / "manifest.json").read_text())


def _write_manifest(data: Path, manifest: dict) -> None:
    (data / "manifest.json").write_text(json.dumps(manifest))


# -- hostile data --------------------------------------------------------------------------


def _modified_shard(data: Path) -> None:
    shard = data / "train_00000.npy"
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # one token changed, the .npy still loads
    shard.write_bytes(bytes(raw))


def _missing_shard(data: Path) -> None:
    (data / "val_00000.npy").unlink()


def _edit(change):
    def make(data: Path) -> None:
        manifest = _manifest(data)
        change(manifest)
        _write_manifest(data, manifest)
    return make


def _train_entry(manifest: dict) -> dict:
    return manifest["splits"]["train"][0]


def _wide_vocab(manifest: dict) -> None:
    manifest["vocab_size"], manifest["dtype"] = 70_000, "uint32"  # shards hold uint16


DATA_CASES = {
    "shard-modified-after-manifest": (_modified_shard, "does not match its manifest sha256"),
    "missing-shard": (_missing_shard, "listed in the manifest is missing"),
    "manifest-dtype-disagrees-with-vocab": (_edit(lambda m: m.update(dtype="uint32")),
                                            "does not match vocab_size"),
    "manifest-dtype-disagrees-with-shards": (_edit(_wide_vocab), "expected 1-D uint32"),
    "manifest-count-too-high": (_edit(lambda m: _train_entry(m).update(
        tokens=_train_entry(m)["tokens"] + 1)), "the manifest says"),
    "manifest-count-negative": (_edit(lambda m: _train_entry(m).update(tokens=-5)),
                                "token count -5"),
    "manifest-count-not-a-number": (_edit(lambda m: _train_entry(m).update(tokens="many")),
                                    "token count 'many'"),
    "manifest-file-not-a-name": (_edit(lambda m: _train_entry(m).update(file=5)),
                                 "shard file 5"),
    "manifest-file-outside-the-dataset": (
        _edit(lambda m: _train_entry(m).update(file="../../escape.npy")), "escape.npy"),
    "manifest-sha256-missing": (_edit(lambda m: _train_entry(m).update(sha256=None)),
                                "sha256 None"),
    "manifest-not-json": (lambda d: (d / "manifest.json").write_text("{not json"),
                          "is not valid JSON"),
    "manifest-missing": (lambda d: (d / "manifest.json").unlink(), "manifest.json not found"),
    "manifest-other-format": (_edit(lambda m: m.update(format="k3-tokens/9")),
                              "is not a k3-tokens/2 manifest"),
    "manifest-without-val-split": (_edit(lambda m: m["splits"].pop("val")), "no split 'val'"),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_hostile_data_is_refused_before_anything_is_written(case, tmp_path, data_dir,
                                                            small_toml, capsys):
    make, match = DATA_CASES[case]
    data = _writable_copy(data_dir, tmp_path / "data")
    make(data)
    run = tmp_path / "run"
    code, err = _cli(["train", "--run-dir", run, "--data", data, "--config", small_toml,
                      "--max-steps", 2], capsys)
    _assert_refused(code, err, match)
    assert not run.exists(), "a refused run wrote into its run directory"
    with pytest.raises(DataError, match=match.split("'")[0]):
        for split in ("train", "val"):  # the library refuses it the same way
            TokenDataLoader(data, split, 4, 16)


@pytest.mark.parametrize("case", ["shard-modified-after-manifest", "missing-shard",
                                  "manifest-count-too-high"])
def test_resume_on_damaged_data_touches_nothing(case, tmp_path, data_dir, small_toml, capsys):
    """The run's data changed between two sessions: --resume refuses and writes nothing."""
    data = _writable_copy(data_dir, tmp_path / "data")
    run = tmp_path / "run"
    code, _ = _cli(["train", "--run-dir", run, "--data", data, "--config", small_toml,
                    "--max-steps", 2, "--warmup-steps", 1, "--decay-steps", 4], capsys)
    assert code == 0
    DATA_CASES[case][0](data)
    before = tree_bytes(run)
    code, err = _cli(["train", "--run-dir", run, "--resume", "--max-steps", 4], capsys)
    _assert_refused(code, err, DATA_CASES[case][1])
    assert tree_bytes(run) == before


def test_empty_corpus_is_refused_and_leaves_no_dataset(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "data"
    code, err = _cli(["prepare", empty, "--out", out], capsys)
    _assert_refused(code, err, "the corpus is empty")
    assert not out.exists() and list(tmp_path.iterdir()) == [empty]  # no staging folder left
    with pytest.raises(DataError, match="empty"):
        prepare_dataset([empty], out)


@pytest.mark.parametrize(("text", "split"), [("tiny corpus " * 4, "train"),
                                             ("x" * 1200, "val")])
def test_dataset_smaller_than_one_batch_is_refused(tmp_path, small_toml, capsys, text, split):
    """Batch 4×16 needs 65 tokens per split: the whole corpus, or just its validation
    share, falls short."""
    source = tmp_path / "small.txt"
    source.write_text(text)
    data = tmp_path / "data"
    assert _cli(["prepare", source, "--out", data], capsys)[0] == 0
    run = tmp_path / "run"
    code, err = _cli(["train", "--run-dir", run, "--data", data, "--config", small_toml],
                     capsys)
    _assert_refused(code, err, f"split '{split}'")
    assert "fewer than one batch" in err[0]
    assert not run.exists()


# -- hostile configuration -------------------------------------------------------------------

NAN, INF = math.nan, math.inf
INVALID_VALUES = [
    ("batch_size", 0), ("batch_size", -4), ("seq_len", 0), ("gradient_accumulation_steps", 0),
    ("expert_parallel", 0), ("pipeline_parallel", 0), ("pp_schedule", "zero-bubble"),
    ("pp_microbatches", 0), ("pp_stages_per_rank", 0), ("context_parallel", 0),
    ("peak_lr", 0.0), ("peak_lr", -1e-3), ("peak_lr", NAN), ("peak_lr", INF),
    ("weight_decay", -0.1), ("weight_decay", NAN), ("adam_beta1", 1.0), ("adam_beta1", -0.1),
    ("adam_beta2", 1.5), ("adam_eps", -1e-8), ("adam_eps", INF), ("muon_momentum", 1.0),
    ("muon_ns_steps", 0), ("muon_ns_dtype", "fp8"), ("muon_ns_coefficients", "newton"),
    ("muon_update_scale", "unit"), ("max_grad_norm", -1.0), ("max_grad_norm", INF),
    ("lr_schedule", "linear"), ("warmup_steps", -1), ("decay_steps", 0),
    ("min_lr_ratio", 1.5), ("min_lr_ratio", -0.1), ("max_steps", 0), ("max_steps", -3),
    ("log_interval", 0), ("eval_interval", 0), ("checkpoint_interval", 0),
    ("eval_batches", 0), ("precision", "fp8"), ("qk_clip_tau", 0.0), ("qk_clip_tau", NAN),
    ("qk_clip_tau", -30.0), ("qk_clip_gqa", "all"), ("seed", -1),
    ("activation_checkpointing", "layer"), ("activation_checkpointing", "full"),
    ("decay_fraction", 0.0), ("decay_fraction", 1.5), ("decay_shape", "exp"),
    ("eval_tokens", 0), ("keep_last", 0), ("keep_last", -2), ("keep_every", 0),
    ("keep_every", -5), ("downstream", ""), ("downstream", "arc_easy,,piqa"),
    ("downstream_interval", 0), ("downstream_limit", 0), ("downstream_limit", -3),
]
WRONG_TYPES = [
    ("batch_size", 4.0), ("batch_size", True), ("batch_size", "4"), ("max_steps", 1.5),
    ("peak_lr", "3e-3"), ("peak_lr", True), ("muon_nesterov", 1), ("qk_clip_enabled", "yes"),
    ("overfit_batch", None), ("precision", 16), ("warmup_steps", 2.5), ("seed", None),
    ("compile", "yes"), ("compile", 1), ("async_checkpoint", "yes"), ("async_checkpoint", 1),
    ("document_masking", "on"), ("document_masking", 1),
    ("muon_normuon", "on"), ("muon_normuon", 1), ("cautious_weight_decay", "yes"),
    ("keep_last", 1.5), ("keep_last", True), ("keep_last", None), ("keep_every", "10"),
    ("keep_every", 2.0), ("downstream", 3), ("downstream", ["arc_easy"]),
    ("downstream_interval", 1.5), ("downstream_limit", None), ("pp_microbatches", 2.0),
]


def test_every_field_has_an_invalid_value_here():
    covered = {name for name, _ in INVALID_VALUES + WRONG_TYPES}
    assert covered == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize(("field", "value"), INVALID_VALUES + WRONG_TYPES)
def test_invalid_train_config_values_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**{**BASE_TRAIN, field: value})


def test_warmup_must_end_before_the_cosine_decay():
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrainConfig(warmup_steps=10, decay_steps=10)
    TrainConfig(warmup_steps=10, decay_steps=10, lr_schedule="constant")  # no horizon there


@pytest.mark.parametrize(("field", "value"), INVALID_VALUES)
def test_invalid_flag_values_are_refused_in_one_line(field, value, tmp_path, data_dir,
                                                     small_toml, capsys):
    run = tmp_path / "run"
    flag = f"--{field.replace('_', '-')}"
    code, err = _cli(["train", "--run-dir", run, "--data", data_dir, "--config", small_toml,
                      f"{flag}={value}"], capsys)
    # A name outside a Literal field's values is argparse's to refuse (it lists them);
    # the rest reach TrainConfig, which names the field.
    listed = field in choices(TrainConfig)
    _assert_refused(code, err, f"argument {flag}: invalid choice: '{value}'" if listed else field)
    assert not run.exists()


# Every number flag, given a word; every boolean flag (--x/--no-x), given a value.
TYPED_FIELDS = [(f.name, "=maybe" if "bool" in str(f.type) else " lots")
                for f in dataclasses.fields(TrainConfig)
                if any(kind in str(f.type) for kind in ("bool", "int", "float"))]


@pytest.mark.parametrize(("field", "bad"), TYPED_FIELDS)
def test_unparsable_flag_values_are_refused_in_one_line(field, bad, tmp_path, capsys):
    flag = f"--{field.replace('_', '-')}"
    run = tmp_path / "run"
    code, err = _cli(["train", "--run-dir", run, *f"{flag}{bad}".split()], capsys)
    _assert_refused(code, err, flag)
    assert not run.exists()


@pytest.mark.parametrize(("field", "value"), [(f, v) for f, v in WRONG_TYPES
                                              if v is not None])  # TOML has no null
def test_wrong_types_in_the_config_file_are_refused(field, value, tmp_path, data_dir, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(toml_text(train={field: value}))
    run = tmp_path / "run"
    code, err = _cli(["train", "--run-dir", run, "--data", data_dir, "--config", config],
                     capsys)
    _assert_refused(code, err, field)
    assert not run.exists()


CONFIG_FILES = {
    "not-toml": ("preset = \n", "is not valid TOML"),
    "unknown-top-level-key": ('preset = "tiny"\noptimizer = "adam"\n', "unknown key 'optimizer'"),
    "top-level-typo": ('presets = "tiny"\n', "unknown key 'presets' (did you mean 'preset'?)"),
    "train-not-a-table": ("train = 5\n", "train must be a table"),
    "model-not-a-table": ('model = "big"\n', "model must be a table"),
    "preset-not-a-string": ("preset = 3\n", "preset must be a string"),
    "unknown-preset": ('preset = "huge"\n', "unknown model preset 'huge'"),
    "unknown-train-field": ("[train]\nlearning_rate = 0.1\n",
                            "bad.toml: [train] has no field 'learning_rate'"),
    "train-field-typo": ("[train]\nmax_step = 3\n",
                         "[train] has no field 'max_step' (did you mean 'max_steps'?)"),
    "unknown-model-field": ("[model]\nwidth = 64\n", "[model] has no field 'width'"),
    "model-field-typo": ("[model]\nn_layer = 2\n",
                         "[model] has no field 'n_layer' (did you mean 'n_layers'?)"),
    "unknown-preset-typo": ('preset = "tinny"\n', "unknown model preset 'tinny'; did you mean "
                            "'tiny'?"),
    "invalid-model-value": ("[model]\nn_layers = 0\n", "n_layers"),
    "seq-len-beyond-the-model": ("[train]\nseq_len = 512\n", "max_seq_len"),
}


@pytest.mark.parametrize("case", list(CONFIG_FILES))
def test_bad_config_files_are_refused(case, tmp_path, data_dir, capsys):
    text, match = CONFIG_FILES[case]
    config = tmp_path / "bad.toml"
    config.write_text(text)
    run = tmp_path / "run"
    code, err = _cli(["train", "--run-dir", run, "--data", data_dir, "--config", config],
                     capsys)
    _assert_refused(code, err, match)
    assert not run.exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data_dir, small_toml):
    """A healthy run at step 2 (the refusals below must leave it byte for byte)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    code = main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(small_toml), "--max-steps", "2", "--warmup-steps", "1",
                 "--decay-steps", "6"])
    assert code == 0
    return run


def test_bad_command_lines_are_refused(tmp_path, data_dir, small_toml, finished_run, capsys):
    run = tmp_path / "run"
    a_file = tmp_path / "file"
    a_file.write_text("")
    existing = _writable_copy(data_dir, tmp_path / "existing-data")
    fresh = ["train", "--run-dir", run, "--data", data_dir, "--config", small_toml]
    cases = [
        ([*fresh, "--bogus", "1"], "unrecognized arguments: --bogus"),
        (["train", "--data", data_dir], "required: --run-dir"),
        ([], "required: COMMAND"),
        ([*fresh, "--device", "toaster"], "unknown device 'toaster'"),
        ([*fresh, "--device", "meta"], "cpu or cuda only"),
        ([*fresh, "--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
        ([*fresh, "--config", tmp_path / "missing.toml"], "missing.toml not found"),
        (["train", "--run-dir", run, "--data", tmp_path / "nodata"], "manifest.json not found"),
        (["train", "--run-dir", a_file, "--data", data_dir], "is a file, not a directory"),
        (["eval", "--run-dir", run], "not found"),
        (["eval", "--run-dir", finished_run, "--batches", "0"], "positive integer"),
        (["eval", "--run-dir", finished_run, "--batches", "-2"], "positive integer"),
        (["prepare", "--out", tmp_path / "p", "--val-fraction", "1.5"], "val_fraction"),
        (["prepare", "--out", existing], "already exists"),
        (["prepare", tmp_path / "nope.txt", "--out", tmp_path / "p"], "nope.txt not found"),
        (["inspect", tmp_path / "nope.pt"], "cannot be read"),
    ]
    for argv, match in cases:
        code, err = _cli(argv, capsys)
        _assert_refused(code, err, match)
    assert not run.exists() and not (tmp_path / "p").exists()


def test_bad_resumes_leave_the_run_untouched(tmp_path, finished_run, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    before = tree_bytes(run)
    resume = ["train", "--run-dir", run, "--resume"]
    cases = [
        ([*resume, "--max-steps", 1], "max_steps"),
        ([*resume, "--max-steps", 4, "--peak-lr", 0.1], "train_config.peak_lr"),
        ([*resume, "--max-steps", 4, "--decay-steps", 9], "train_config.decay_steps"),
        (["train", "--run-dir", run, "--data", finished_run.parent], "already holds a run"),
    ]
    for argv, match in cases:
        code, err = _cli(argv, capsys)
        _assert_refused(code, err, match)
        assert tree_bytes(run) == before, argv


@pytest.mark.parametrize(("damage", "match"), [
    (lambda record: "{", "run.json is unreadable"),
    (lambda record: json.dumps({k: v for k, v in record.items() if k != "model_config"}),
     "lacks train_config, model_config or data.dir"),
    (lambda record: json.dumps({**record, "train_config": [1, 2]}),
     "lacks train_config, model_config or data.dir"),
    (lambda record: json.dumps({**record, "model_config": {**record["model_config"],
                                                           "n_heads": "two"}}), "n_heads"),
])
def test_a_damaged_run_record_is_refused(tmp_path, finished_run, capsys, damage, match):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(damage(record))
    before = tree_bytes(run)
    for argv in (["train", "--run-dir", run, "--resume", "--max-steps", 4],
                 ["eval", "--run-dir", run]):
        code, err = _cli(argv, capsys)
        _assert_refused(code, err, match)
    assert tree_bytes(run) == before


def test_resuming_a_complete_run_succeeds_with_nothing_to_do(tmp_path, finished_run, capsys):
    """A supervisor that restarts with --resume until success (a requeued job, a shell
    `until` loop) must terminate: a complete run is a success, in one line, untouched."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    before = tree_bytes(run)
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["k3-train: run already complete at step 2; nothing to do "
                                    "(raise --max-steps to extend it)"]
    assert tree_bytes(run) == before


@pytest.mark.parametrize("left", ["nothing", "staging"])
def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_it_again(
        tmp_path, finished_run, capsys, left):
    """run.json and metrics.jsonl but no checkpoint (killed or failed before the first
    save, which may have left its hidden staging folder): --resume has nothing to lose, so
    it starts the recorded run from scratch."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    shutil.rmtree(run / "checkpoints")  # the run's every checkpoint
    if left == "staging":  # killed half-way through writing its first checkpoint
        staged = run / "checkpoints" / ".step-00000002.tmp"
        staged.mkdir(parents=True)
        (staged / "k3.ckpt.tmp").write_bytes(
            latest_checkpoint(finished_run).read_bytes()[:1000])
    metrics = run / "metrics.jsonl"  # killed before its first save: no checkpoint event
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if '"event": "checkpoint"' not in line))
    code, err = _cli(["train", "--run-dir", run, "--data", run.parent], capsys)
    _assert_refused(code, err, "stopped before its first checkpoint")
    assert "pass --resume to start it again" in err[0]
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "stopped before its first checkpoint; nothing to resume, so the run starts from " \
        "scratch" in err
    events = read_events(run / "metrics.jsonl")
    starts = [e for e in events if e["event"] == "session_start"]
    assert len(starts) == 1 and starts[0]["step"] == 0  # the dead session's events are gone
    assert read_payload(latest_checkpoint(run))["counters"]["step"] == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest",
                                                                      "step-00000002"]
    fresh = read_payload(latest_checkpoint(finished_run))
    for key, tensor in fresh["model"].items():  # the recorded recipe, bitwise
        assert torch.equal(tensor, read_payload(latest_checkpoint(run))["model"][key]), key


@pytest.mark.parametrize("removed", ["history", "step"])
def test_resume_refuses_a_run_whose_recorded_checkpoint_is_missing(tmp_path, finished_run,
                                                                   capsys, removed):
    """metrics.jsonl says a checkpoint was saved: a missing one was moved or deleted (the
    whole history, or the step folder ``latest`` names), and starting over would throw the
    run away (and its metrics.jsonl with it)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    shutil.rmtree(run / ("checkpoints" if removed == "history"
                         else "checkpoints/step-00000002"))
    before = tree_bytes(run)
    code, err = _cli(["train", "--run-dir", run, "--resume"], capsys)
    _assert_refused(code, err, "records a checkpoint saved at step 2, but")
    assert "put it back, or choose another --run-dir" in err[0]
    assert tree_bytes(run) == before


@pytest.mark.parametrize("state", ["absent", "empty"])
def test_resume_of_an_absent_or_empty_run_directory_starts_the_run(tmp_path, data_dir,
                                                                   small_toml, capsys, state):
    """A supervisor's `until k3-train train ... --resume; do :; done` always ends, even
    when the first session was killed before it wrote anything."""
    run = tmp_path / "run"
    if state == "empty":
        run.mkdir()
    code, err = _cli(["train", "--run-dir", run, "--resume", "--data", data_dir, "--config",
                      small_toml, "--max-steps", 2], capsys)
    assert code == 0, err
    assert err[0] == f"k3-train: {run} holds no run yet; nothing to resume, so the run starts"
    assert read_payload(latest_checkpoint(run))["counters"]["step"] == 2


def test_a_resume_on_other_data_names_both_folders(tmp_path, data_dir, finished_run, capsys):
    other = tmp_path / "other-data"
    text = tmp_path / "other.txt"
    text.write_text("other data " * 3000)
    prepare_dataset([text], other)
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    code, err = _cli(["train", "--run-dir", run, "--resume", "--data", other, "--max-steps", 4],
                     capsys)
    _assert_refused(code, err, f"--data {other} belongs to different data than the run")
    recorded = json.loads((run / "run.json").read_text())["data"]["dir"]
    assert f"the run was trained on {recorded}, this session reads {other}" in err[0]
    assert "start a new phase of it (--phase NAME)" in err[0]


def test_other_data_of_a_larger_vocabulary_is_named_as_other_data(tmp_path, finished_run,
                                                                  capsys):
    """Not "choose a bigger preset": the data is what is wrong."""
    text = tmp_path / "other.txt"
    text.write_text("other data " * 3000)
    other = tmp_path / "bpe"
    prepare_dataset([text], other, PrepareOptions(train_tokenizer=400))
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    code, err = _cli(["train", "--run-dir", run, "--resume", "--data", other, "--max-steps", 4],
                     capsys)
    _assert_refused(code, err, f"--data {other} belongs to different data than the run")
    assert "preset" not in err[0]


def test_shards_are_prepared_read_only(data_dir):
    """What makes "modified after its manifest" an accident rather than a habit."""
    for shard in data_dir.glob("*.npy"):
        assert not shard.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
        assert np.load(shard, mmap_mode="r").dtype == np.uint16
