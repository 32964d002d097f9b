"""``k3-train export``: a run's latest checkpoint as a Hugging Face hub folder with its
tokenizer, written by the run's model spec's hub format."""

from __future__ import annotations

from .build import parse_device, restore
from .hub import export_model
from .options import ExportCommand


def run(command: ExportCommand, notes: tuple[str, ...] = ()) -> int:
    run_ = restore(command.run_dir, command.data, parse_device(command.device), command.step)
    codec = run_.codec()
    written = export_model(run_.model.cpu(), run_.spec, codec, command.out,
                           max_seq_len=run_.max_seq_len, dtype=command.dtype,
                           overwrite=command.overwrite)
    size = sum(p.stat().st_size for p in written.iterdir())
    assert run_.spec.hub is not None  # export_model refused a spec without one
    print(f"k3-train: exported step {run_.state.step} of {command.run_dir} to {written} "
          f"({command.dtype}, {size / 2**20:.1f} MiB); "
          f"{run_.spec.hub.describe(run_.model_config)}")
    return 0
