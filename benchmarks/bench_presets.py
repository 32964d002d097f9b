"""Per preset: tokens/s of a training step and the share of data loading and the optimizer.

Run: ``hatch run bench:presets`` (``--quick``: tiny only, fewer steps). Each step is timed
in three parts — ``TokenDataLoader.next_batch``, forward+backward, ``MuonAdamW.step`` — in
fp32 on the CPU (bf16 autocast on CUDA). Presets too large for the device are skipped
with a message rather than run for hours.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import print_table, write_json
from k3_model import K3Model, count_parameters, preset
from k3_trainer import TokenDataLoader, TrainConfig, build_optimizer, prepare_dataset

# (batch, seq) per preset on CPU; the small preset's 32k vocabulary makes it ~30× tiny.
CPU_SHAPES = {"tiny": (16, 128), "small": (4, 128)}
CUDA_SHAPES = {"tiny": (16, 128), "small": (16, 1024), "base": (8, 2048)}


def measure(name: str, batch: int, seq: int, steps: int, data: Path,
            device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    config = TrainConfig(batch_size=batch, seq_len=seq, max_steps=steps + 2)
    model = K3Model(preset(name)).to(device)
    optimizer = build_optimizer(model, config)
    loader = TokenDataLoader(data, "train", batch, seq)
    parts: dict[str, list[float]] = {"data": [], "forward+backward": [], "optimizer": []}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for index in range(steps + 2):  # two warm-up steps
        marks = [time.perf_counter()]
        x, y = (t.to(device) for t in loader.next_batch())
        sync()
        marks.append(time.perf_counter())
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss = model(x, targets=y)
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        marks.append(time.perf_counter())
        if index >= 2:
            for key, a, b in zip(parts, marks, marks[1:]):
                parts[key].append(b - a)
    medians = {k: statistics.median(v) for k, v in parts.items()}
    step = sum(medians.values())
    return {"params": count_parameters(model.config).total, "batch": batch, "seq": seq,
            "step_s": step, "tokens_per_s": batch * seq / step,
            "data_share": medians["data"] / step, "optimizer_share": medians["optimizer"] / step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = CUDA_SHAPES if device.type == "cuda" else CPU_SHAPES
    names = ["tiny"] if args.quick else list(shapes)
    if device.type == "cpu":
        print("preset base: skipped on CPU (1.7 B parameters; GPU-sized)")
    data = Path(tempfile.mkdtemp()) / "builtin"
    prepare_dataset([], data)
    results, rows = {}, []
    for name in names:
        batch, seq = shapes[name]
        r = measure(name, batch, seq, args.steps or (3 if args.quick else 10), data, device)
        results[name] = r
        rows.append([name, f"{r['params'] / 1e6:.1f}M", f"{batch}×{seq}",
                     f"{r['step_s'] * 1e3:.0f}", f"{r['tokens_per_s']:,.0f}",
                     f"{r['data_share']:.2%}", f"{r['optimizer_share']:.1%}"])
    print_table(f"Training step per preset on {device.type} ("
                f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'})",
                ["preset", "params", "batch", "step ms", "tokens/s", "data loader",
                 "optimizer"], rows)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
