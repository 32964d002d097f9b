"""Accelerators the planner knows: memory and dense bf16 peak.

Figures are the vendors' data-sheet numbers for the SXM/OAM parts (dense, no sparsity):
NVIDIA H100 SXM 80 GB and 989.4 TFLOPS bf16; H200 SXM 141 GB (the same compute as
H100); B200 180 GB and ~2,250 TFLOPS bf16 dense (HGX B200 sheet: 18 PFLOPS sparse FP16
for eight, halved for dense); AMD MI300X 192 GB and 1,307.4 TFLOPS bf16 dense. Memory
is in GB (10⁹ bytes) as sold; ``--gpu-memory``/``--peak-tflops`` override either.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """One accelerator: usable memory in bytes and dense bf16 peak in FLOP/s."""

    name: str
    memory_bytes: int
    peak_flops: float


GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM 80GB", 80 * 10**9, 989.4e12),
    "h200": GPU("H200 SXM 141GB", 141 * 10**9, 989.4e12),
    "b200": GPU("B200 180GB", 180 * 10**9, 2250e12),
    "mi300x": GPU("MI300X 192GB", 192 * 10**9, 1307.4e12),
}


def gpu(name: str, memory_gb: float | None = None, peak_tflops: float | None = None) -> GPU:
    """The named GPU with ``memory_gb`` (10⁹ bytes) or ``peak_tflops`` replaced."""
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r} is not known; choose one of {', '.join(GPUS)} "
                         "(or give --gpu-memory and --peak-tflops)")
    base = GPUS[name]
    memory = base.memory_bytes if memory_gb is None else int(memory_gb * 10**9)
    peak = base.peak_flops if peak_tflops is None else peak_tflops * 1e12
    if memory <= 0 or peak <= 0:
        raise ValueError("--gpu-memory and --peak-tflops must be > 0")
    return GPU(base.name, memory, peak)
