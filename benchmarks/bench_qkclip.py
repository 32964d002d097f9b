"""QK-Clip observation overhead: forward+backward of an attention block, observed vs not.

Runs a pre-norm residual attention block (k3_qkclip.reference modules, fp32, training
mode) three ways, interleaved round by round in one process so machine noise hits all
of them alike:

  off       no QKClip context: plain scaled_dot_product_attention
  on        inside QKClip: SDPA + the exact per-head max (one no-grad QKᵀ), the shipped path
  explicit  alternative design, for comparison: explicit softmax(QKᵀ)V whose scores are
            reused for the max (no duplicate matmul, but no fused attention kernel)

Prints median milliseconds per forward+backward, the min–max spread, and each variant's
ratio to `off` (median of per-round ratios, with their min–max). Also times
validate()+apply(), which run once per optimizer update. Target: `on` ≤ 1.10× `off` at
seq 256 on CPU. Needs k3-qkclip installed (e.g. the bench hatch environment).

    python benchmarks/bench_qkclip.py                  # full: seq 256, 30 rounds
    python benchmarks/bench_qkclip.py --quick          # a smoke run in a few seconds
    python benchmarks/bench_qkclip.py --json out.json  # also save the timings
    python benchmarks/bench_qkclip.py --device cuda --amp --seq 2048 --dim 2048 --heads 16
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import k3_qkclip.reference as reference
from common import interleaved, print_table, write_json
from k3_qkclip import QKClip, QKClipPolicy, QKObserver
from k3_qkclip.reference import ReferenceAttention, ReferenceMLA

TARGET = 1.10  # issue 3: observation costs at most 10 % at seq 256 on CPU


class Block(nn.Module):
    """x + attention(rmsnorm(x)): the attention half of a decoder layer."""

    def __init__(self, attention: nn.Module, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.attention = attention

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.attention(self.norm(x))
        return out


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, observer: QKObserver | None = None, **_: object
) -> Tensor:
    """softmax(QKᵀ·scale + causal mask)·V with the scores reused for the observation."""
    b, h, t, e = q.shape
    hkv = k.shape[1]
    if observer is None or not observer.active:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != h)
    g = h // hkv
    scores = torch.matmul((q * e**-0.5).reshape(b, hkv, g * t, e), k.transpose(-1, -2))
    scores = scores.view(b, hkv, g, t, t)
    scores.masked_fill_(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    observer.record(scores.detach().amax(dim=(0, 3, 4)).reshape(h))
    probs = scores.softmax(dim=-1).view(b, hkv, g * t, t)
    return torch.matmul(probs, v).view(b, h, t, v.shape[-1])


@contextlib.contextmanager
def variant(name: str, clip: QKClip | None) -> Iterator[None]:
    """Run a block of code as ``name``: no context, the shipped path, or the alternative."""
    if clip is None:
        yield
        return
    saved = reference.__dict__["observed_attention"]
    if name == "explicit":  # the reference modules look the function up at call time
        setattr(reference, "observed_attention", explicit_attention)  # noqa: B010
    try:
        with clip:
            yield
    finally:
        setattr(reference, "observed_attention", saved)  # noqa: B010


def build(kind: str, dim: int, heads: int) -> nn.Module:
    head_dim = dim // heads
    attention: nn.Module
    if kind == "mha":
        attention = ReferenceAttention(dim, heads)
    elif kind == "gqa":
        attention = ReferenceAttention(dim, heads, max(1, heads // 4))
    else:  # K2-like proportions: nope = head_dim, rope = head_dim / 2, latent = dim / 2
        attention = ReferenceMLA(dim, heads, head_dim, head_dim // 2, head_dim, dim // 2)
    return Block(attention, dim)


def fwd_bwd(model: nn.Module, x: Tensor, amp: bool) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, torch.bfloat16, enabled=amp):
        loss = model(x).float().square().mean()
    loss.backward()


def run(kind: str, args: argparse.Namespace) -> dict[str, object]:
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build(kind, args.dim, args.heads).to(device).train()
    x = torch.randn(args.batch, args.seq, args.dim, device=device)
    policy = QKClipPolicy(tau=100.0)
    clips = {"off": None, "on": QKClip(model, policy), "explicit": QKClip(model, policy)}

    def case(name: str) -> Callable[[], None]:
        def go() -> None:
            with variant(name, clips[name]):
                for _ in range(args.inner):
                    fwd_bwd(model, x, args.amp)

        return go

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    timings = interleaved(
        {name: case(name) for name in clips}, repeats=args.rounds, warmup=2, sync=sync
    )
    base = timings["off"]
    rows: list[list[str]] = []
    results: dict[str, object] = {}
    target_config = args.seq == 256 and device.type == "cpu"  # where the target is set
    for name, timing in timings.items():
        ratios = [t / b for t, b in zip(timing.seconds, base.seconds)]
        ratio = statistics.median(ratios)
        verdict = ""
        if name == "on":
            verdict = ("met" if ratio <= TARGET else "missed") if target_config else "n/a"
        rows.append([name, f"{timing.median / args.inner * 1e3:.2f}",
                     f"{min(timing.seconds) / args.inner * 1e3:.2f}–"
                     f"{max(timing.seconds) / args.inner * 1e3:.2f}",
                     f"{ratio:.3f}", f"{min(ratios):.3f}–{max(ratios):.3f}", verdict])  # fmt: skip
        results[name] = {"seconds": timing.seconds, "inner": args.inner, "ratio": ratio}

    update_ms = []  # validate() + apply(): once per optimizer update, not per forward
    on = clips["on"]
    assert on is not None
    with on:
        for _ in range(max(3, args.rounds // 3)):
            fwd_bwd(model, x, args.amp)
            if sync:
                sync()
            start = time.perf_counter()
            on.validate()
            on.apply()
            if sync:
                sync()
            update_ms.append((time.perf_counter() - start) * 1e3)
    results["validate_apply_ms"] = statistics.median(update_ms)
    print_table(
        f"{kind}: batch {args.batch}, seq {args.seq}, dim {args.dim}, {args.heads} heads, "
        f"forward+backward ({args.rounds} interleaved rounds)",
        ["variant", "median ms", "min–max ms", "× off", "× off min–max", "≤ 1.10 at seq 256"],
        rows,
    )
    print(f"\nvalidate() + apply() per update: median {results['validate_apply_ms']:.3f} ms")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--kinds", default="mha,gqa,mla")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--inner", type=int, default=2, help="fwd+bwd per timed sample")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast (use on CUDA)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.dim, args.rounds, args.inner = 2, 128, 256, 5, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    precision = "bf16 autocast" if args.amp else "fp32"
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {precision}, {where}")
    results: dict[str, object] = {k.strip(): run(k.strip(), args) for k in args.kinds.split(",")}
    write_json(args.json, results)


if __name__ == "__main__":
    main()
