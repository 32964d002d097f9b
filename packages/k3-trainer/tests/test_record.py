"""``run.json`` through :class:`RunRecord`: a record reads and writes back unchanged, an
older one upgrades (later keys read as their defaults, unknown keys and the keys' order
kept), and a damaged one is refused in one line naming what is wrong."""

from __future__ import annotations

import json

import pytest

from k3_trainer.record import (
    RUN_RECORD,
    Branch,
    DataParallel,
    Host,
    Phase,
    RecordedData,
    RecordedSource,
    RecordError,
    RunRecord,
    Session,
)

SESSION = {"started": "2025-01-01T00:00:00+0000", "command": ["k3-train", "train"],
           "resumed_from_step": None, "device": "cpu", "versions": {"python": "3.11.7"},
           "host": {"hostname": "h", "platform": "p", "cpu": "c", "cpu_count": 2,
                    "torch_threads": 2, "cuda": None}}
OLD = {"created": "2025-01-01T00:00:00+0000", "sessions": [SESSION],
       "train_config": {"max_steps": 2}, "model_config": {"d_model": 32}, "preset": "tiny",
       "data": {"dir": "/data", "manifest_digest": "abc"}}
"""A 0.1 record: no model, sources, phases, branches or init_from."""


def _write(tmp_path, record):
    (tmp_path / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def test_a_current_record_is_written_back_byte_for_byte(tmp_path):
    session = {**SESSION, "resumed_from_step": 4, "resumed_from": "/run/step-4", "branch": 4,
               "data_parallel": {"mode": "fsdp", "world_size": 2, "expert_parallel": 2},
               "phase": "anneal"}
    record = {**OLD, "sessions": [SESSION, session], "model": "k3",
              "data": {"dir": "/web", "manifest_digest": "abc", "sources": [
                  {"name": "web", "dir": "/web", "weight": 0.7, "manifest_digest": "abc"}]},
              "branches": [{"from": "/run/step-4", "step": 4, "superseded_records": 3}],
              "phases": [{"name": "anneal", "step": 4, "changes": {"data": ["/a", "/b"]}}],
              "init_from": "/hub"}
    _write(tmp_path, record)
    read = RunRecord.read(tmp_path)
    assert read.last_session is not None and read.last_session.host.torch_threads == 2
    assert read.last_session.data_parallel == DataParallel("fsdp", 2, 2)
    assert read.data.sources == (RecordedSource("web", "/web", 0.7, "abc"),)
    assert read.phases == (Phase("anneal", 4, {"data": ["/a", "/b"]}),)
    assert read.branches == (Branch("/run/step-4", 4, 3),)
    before = (tmp_path / RUN_RECORD).read_text()
    read.write(tmp_path)
    assert (tmp_path / RUN_RECORD).read_text() == before


def test_an_older_record_upgrades_and_keeps_what_it_does_not_know(tmp_path):
    _write(tmp_path, {**OLD, "future": {"x": 1},
                      "sessions": [{**SESSION, "gpu_count": 8}]})
    old = RunRecord.read(tmp_path)
    assert (old.model, old.data.sources, old.phases, old.branches, old.init_from) == (
        "k3", (), (), (), None)
    session = Session("now", ("k3-train",), "cpu", resumed_from_step=2, host=Host("h"))
    old.with_session(session, train_config={"max_steps": 4}, model="k3",
                     model_config={"d_model": 32}, preset="tiny",
                     data=RecordedData("/data", "abc"), phase=Phase("anneal", 2)).write(tmp_path)
    written = json.loads((tmp_path / RUN_RECORD).read_text())
    assert list(written) == [*OLD, "future", "model", "phases"]  # read keys first, in order
    assert written["future"] == {"x": 1} and written["sessions"][0]["gpu_count"] == 8
    assert written["sessions"][1]["phase"] == "anneal" and written["train_config"] == {
        "max_steps": 4}


@pytest.mark.parametrize(("text", "match"), [
    ("{", "run.json is unreadable"),
    ("[]", "run.json is not a k3-train run record"),
    (json.dumps({k: v for k, v in OLD.items() if k != "model_config"}),
     "run.json lacks train_config, model_config or data.dir"),
    (json.dumps({**OLD, "data": {"dir": "/d", "sources": [{"name": "web"}]}}),
     "run.json's data.sources is damaged"),
])
def test_a_damaged_record_is_refused_in_one_line(tmp_path, text, match):
    (tmp_path / RUN_RECORD).write_text(text)
    with pytest.raises(RecordError, match=match) as refused:
        RunRecord.read(tmp_path)
    assert "\n" not in str(refused.value)


def test_a_partial_record_reads_what_it_holds(tmp_path):
    """The report shows what a hand-written or cut-short record holds."""
    _write(tmp_path, {"train_config": {"qk_clip_tau": 30.0}})
    with pytest.raises(RecordError, match="lacks"):
        RunRecord.read(tmp_path)
    partial = RunRecord.read(tmp_path, partial=True)
    assert partial.train_config == {"qk_clip_tau": 30.0} and partial.model_config == {}
    with pytest.raises(FileNotFoundError, match="not a k3-train run directory"):
        RunRecord.read(tmp_path / "elsewhere", partial=True)
