"""Hub-format export and import against plain torch.save / torch.load of the same weights.

Per preset, interleaved in one process: ``save_pretrained`` (renaming to the hub's names,
splitting the expert stacks, writing safetensors, fsync of every file and the folder, the
atomic rename) against ``torch.save`` of the state dict plus fsync; ``load_pretrained``
(config, header and shape checks, then building the model and loading it) against
building the model and ``torch.load`` + ``load_state_dict``. Each row gives the medians,
the ratio and the min-max of the per-repeat ratios. No target: the rows say what leaving
the project costs next to keeping a plain checkpoint.

    python benchmarks/bench_hub.py                 # tiny (the demo's model) and small
    python benchmarks/bench_hub.py --quick         # tiny, 3 repeats (smoke test)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from common import interleaved, print_table, write_json
from k3_model import K3Model, preset
from k3_model.hub import load_pretrained, save_pretrained


def measure(name: str, repeats: int, root: Path) -> dict[str, object]:
    torch.manual_seed(0)
    config = preset(name)
    model = K3Model(config)
    state = model.state_dict()
    size = sum(t.numel() * t.element_size() for t in state.values())
    hub, plain = root / f"{name}-hub", root / f"{name}.pt"

    def export() -> None:
        save_pretrained(model, hub, overwrite=True)

    def save() -> None:  # what save_pretrained's durability costs, on the baseline too
        torch.save(state, plain)
        for path in (plain, root):  # the file, then its folder
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

    def import_hub() -> None:
        load_pretrained(hub)

    def load() -> None:
        with torch.random.fork_rng(devices=[]):
            fresh = K3Model(config)
        fresh.load_state_dict(torch.load(plain, weights_only=True))

    export(), save()  # the files the loads read
    saves = interleaved({"save_pretrained": export, "torch.save + fsync": save},
                        repeats=repeats)
    loads = interleaved({"load_pretrained": import_hub, "torch.load + load_state_dict": load},
                        repeats=repeats)
    rows = {}
    for label, timing, (candidate, baseline) in (
            ("export", saves, ("save_pretrained", "torch.save + fsync")),
            ("import", loads, ("load_pretrained", "torch.load + load_state_dict"))):
        ratios = [a / b for a, b in zip(timing[candidate].seconds, timing[baseline].seconds)]
        rows[label] = {"seconds": timing[candidate].median,
                       "baseline_seconds": timing[baseline].median,
                       "ratio": timing[candidate].median / timing[baseline].median,
                       "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "ratio_median": statistics.median(ratios)}
    return {"preset": name, "bytes": size, **rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--presets", nargs="*", default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    presets = args.presets or (["tiny"] if args.quick else ["tiny", "small"])
    repeats = args.repeats or (3 if args.quick else 7)
    root = Path(tempfile.mkdtemp(prefix="bench-hub-"))
    try:
        results = [measure(name, repeats, root) for name in presets]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = []
    for r in results:
        for label, base in (("export", "torch.save + fsync"),
                            ("import", "torch.load + load_state_dict")):
            row = r[label]
            rows.append([r["preset"], f"{r['bytes'] / 2**20:.1f} MiB", label,
                         f"{row['seconds'] * 1e3:.0f} ms",
                         f"{base} {row['baseline_seconds'] * 1e3:.0f} ms",
                         f"{row['ratio']:.2f}×", f"{row['ratio_min']:.2f}–{row['ratio_max']:.2f}"])
    print_table(f"Hub format (fp32, {repeats} repeats, interleaved)",
                ["preset", "weights", "", "hub", "baseline", "ratio", "per-repeat"], rows)
    write_json(args.json, {"hub": results})


if __name__ == "__main__":
    main()
