"""``k3-train export``: a run's latest checkpoint as a Hugging Face hub folder with its
tokenizer, written by the run's model spec's hub format."""

from __future__ import annotations

from ..hub import export_model
from ..session import parse_device, restore
from .options import ExportCommand


def run(command: ExportCommand, notes: tuple[str, ...] = ()) -> int:
    """Export the run's checkpoint into ``--out``: a new or empty folder, or with
    ``--overwrite`` a previous export (anything else is refused naming what it holds),
    replaced only once the new folder is complete."""
    run_ = restore(command.run_dir, command.data, parse_device(command.device), command.step)
    codec = run_.codec()
    out = command.out
    replacing = command.overwrite and out.is_dir() and not out.is_symlink() \
        and any(out.iterdir())
    written = export_model(run_.model.cpu(), run_.spec, codec, out,
                           max_seq_len=run_.max_seq_len, dtype=command.dtype,
                           overwrite=command.overwrite,
                           document_masking=run_.config.document_masking)
    size = sum(p.stat().st_size for p in written.iterdir())
    assert run_.spec.hub is not None  # export_model refused a spec without one
    replaced = ", replacing the previous export" if replacing else ""
    print(f"k3-train: exported step {run_.state.step} of {command.run_dir} to {written}"
          f"{replaced} ({command.dtype}, {size / 2**20:.1f} MiB); "
          f"{run_.spec.hub.describe(run_.model_config)}")
    return 0
