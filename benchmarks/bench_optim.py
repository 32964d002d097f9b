"""k3-optim benchmarks: the whole optimizer step against torch.optim.Muon with its gains
attributed and its floor, Gram against standard Newton–Schulz (the ``auto`` threshold),
NS per dtype/set, batching, foreach vs per-tensor elementwise work, distributed Muon vs
every rank doing all NS.

Run: ``hatch run bench:optim`` (add ``--quick`` for a smoke run, ``--json PATH`` to save,
``--only NAME`` for one table). Every table compares candidates timed interleaved in one
process (the distributed table: in each of 2 gloo ranks, reported by rank 0).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import interleaved, print_table, write_json
from k3_optim import GRAM_MIN_ASPECT, MuonAdamW, matrix_view_shape, newton_schulz
from k3_optim.muon import muon_update
from optim_step import SMALL_GROUPS, bench_floor, bench_step


def small_like_groups(quick: bool, seed: int = 0) -> list[dict[str, object]]:
    """Param groups shaped like the `small` preset's (``quick``: a quarter of the tensors
    and a 4096-token vocabulary), each parameter with a fixed random gradient."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for name, (use_muon, heads, shapes) in SMALL_GROUPS.items():
        params = []
        for shape, count in shapes:
            if quick:
                count = max(1, count // 4)
                shape = (4096, *shape[1:]) if shape[0] == 32768 else shape
            for _ in range(count):
                p = torch.randn(*shape, generator=gen).mul_(0.02).requires_grad_()
                p.grad = torch.randn(*shape, generator=gen)
                params.append(p)
        group: dict[str, object] = {"params": params, "use_muon": use_muon, "name": name}
        if heads:
            group["num_heads"] = heads
        if name == "adamw_no_decay":
            group["weight_decay"] = 0.0
        groups.append(group)
    return groups


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench_gram(args: argparse.Namespace) -> dict[str, object]:
    """Gram against standard Newton–Schulz per aspect ratio: time ratio and agreement."""
    sizes = [64] if args.quick else [128, 256, 512]
    ratios = [2, 4] if args.quick else [1.5, 2, 2.5, 3, 4, 6]
    rows, results = [], {}
    for dtype in ["fp32", "bf16"]:
        for m in sizes:
            for r in ratios:
                n = int(m * r)
                batch = max(1, (1 << 21) // (m * n))  # about 2 M elements per call
                G = torch.randn(batch, m, n, generator=torch.Generator().manual_seed(m + n))
                cases = {meth: functools.partial(newton_schulz, G, dtype=dtype, method=meth)
                         for meth in ("standard", "gram")}
                t = interleaved(cases, repeats=2 if args.quick else 7, warmup=1)
                ratio = min(t["gram"].seconds) / min(t["standard"].seconds)
                exact = newton_schulz(G.double(), dtype="fp64")
                errors = {meth: _rel(fn(), exact) for meth, fn in cases.items()}
                rows.append([dtype, f"{batch} × {m}×{n}", f"{r:g}",
                             f"{min(t['standard'].seconds) * 1e3:.2f}",
                             f"{min(t['gram'].seconds) * 1e3:.2f}", f"{ratio:.2f}",
                             f"{errors['standard']:.1e}", f"{errors['gram']:.1e}",
                             "gram" if r >= GRAM_MIN_ASPECT else "standard"])
                results[f"{dtype}/{m}x{n}"] = {"gram_over_standard": ratio, **{
                    f"rel_err_{k}": v for k, v in errors.items()}}
    print_table(f"Gram vs standard Newton–Schulz (5 steps, jordan; fastest of the rounds; "
                f"error: Frobenius, against the fp64 iteration); auto takes Gram from aspect "
                f"{GRAM_MIN_ASPECT:g}", ["dtype", "stack", "aspect", "standard ms", "gram ms",
                                         "gram / standard", "err standard", "err gram",
                                         "auto picks"], rows)
    return results


def _ns_flops(m: int, n: int, steps: int) -> float:
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m**3)


def bench_ns_accuracy(args: argparse.Namespace) -> dict[str, object]:
    m, n = (128, 512) if args.quick else (256, 1024)
    G = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
    cases, refs = {}, {}
    for coefficients in ["jordan", "polar_express"]:
        refs[coefficients] = newton_schulz(G.double(), coefficients=coefficients, dtype="fp64")
        for dtype in ["bf16", "fp32", "fp64"]:
            for method in ["standard", "gram"]:
                cases[(coefficients, dtype, method)] = functools.partial(
                    newton_schulz, G, coefficients=coefficients, dtype=dtype, method=method)
    timings = interleaved({" ".join(key): fn for key, fn in cases.items()},
                          repeats=1 if args.quick else 3)
    rows, results = [], {}
    for (coefficients, dtype, method), fn in cases.items():
        out = fn().double()
        s = torch.linalg.svdvals(out)
        gram = out @ out.T - torch.eye(m, dtype=torch.float64)
        rel = float((out - refs[coefficients]).norm() / refs[coefficients].norm())
        t = timings[f"{coefficients} {dtype} {method}"]
        sigma_err, gram_err = float((s - 1).abs().max()), float(gram.norm())
        rows.append([coefficients, dtype, method, f"{t.median * 1e3:.1f}",
                     f"{sigma_err:.3f}", f"{gram_err:.3f}", f"{rel:.1e}"])
        results[f"{coefficients}/{dtype}/{method}"] = {
            "median_s": t.median, "max_abs_sigma_minus_1": sigma_err, "gram_err": gram_err,
            "rel_err_vs_fp64": rel}
    print_table(f"Newton–Schulz, 5 steps on {m}×{n} (Gaussian), per dtype, set and method "
                "(error: Frobenius, against the same set's fp64 standard iteration)",
                ["set", "dtype", "method", "median ms", "max|σ−1|", "‖OOᵀ−I‖_F",
                 "rel. err vs fp64"], rows)
    return results


def bench_throughput(args: argparse.Namespace) -> dict[str, object]:
    shapes = [(512, 512)] if args.quick else [(512, 512), (1024, 1024), (768, 3072)]
    rows, results = [], {}
    for m, n in shapes:
        G = torch.randn(m, n)
        A, B = torch.randn(m, m), torch.randn(m, n)
        timings = interleaved({"ns": lambda G=G: newton_schulz(G, dtype="fp32"),
                               "mm": lambda A=A, B=B: torch.mm(A, B)},
                              repeats=2 if args.quick else 5)
        ns_rate = _ns_flops(m, n, 5) / timings["ns"].median / 1e9
        mm_rate = 2 * m * m * n / timings["mm"].median / 1e9
        rows.append([f"{m}×{n}", f"{ns_rate:.1f}", f"{mm_rate:.1f}", f"{ns_rate / mm_rate:.2f}"])
        results[f"{m}x{n}"] = {"ns_gflops": ns_rate, "matmul_gflops": mm_rate}
    print_table("NS fp32 throughput vs a plain fp32 matmul ((m×m)·(m×n))",
                ["shape", "NS GFLOP/s", "matmul GFLOP/s", "NS / matmul"], rows)
    return results


def bench_batching(args: argparse.Namespace) -> dict[str, object]:
    count = 16 if args.quick else 48
    G = torch.randn(count, 64, 256)
    timings = interleaved({"looped": lambda: [newton_schulz(g) for g in G],
                           "batched": lambda: newton_schulz(G)},
                          repeats=3 if args.quick else 7)
    loop, batch = timings["looped"], timings["batched"]
    print_table(f"{count} × (64×256) fp32: one batched NS call vs a loop",
                ["variant", "median ms", "min–max ms", "× looped"],
                [[t.name, f"{t.median * 1e3:.1f}", t.spread(), f"{t.median / loop.median:.2f}"]
                 for t in (loop, batch)])
    return {"looped_s": loop.median, "batched_s": batch.median}


def bench_foreach(args: argparse.Namespace) -> dict[str, object]:
    """Muon's elementwise work as torch._foreach_* calls vs one tensor at a time."""
    optimizers = {}
    for name, foreach in [("per-tensor", False), ("foreach", True)]:
        opt = MuonAdamW(small_like_groups(args.quick), lr=0.02, foreach=True)
        opt._foreach = foreach  # the private switch: same arithmetic, one tensor at a time
        optimizers[name] = opt

    # The Muon half with Newton–Schulz replaced by the identity: only elementwise work.
    work = []
    for group in small_like_groups(args.quick, seed=1):
        if group["use_muon"]:
            params = [p.detach() for p in group["params"]]  # type: ignore[attr-defined]
            work.append((params, [p.grad for p in group["params"]],  # type: ignore[attr-defined]
                         [torch.zeros_like(p) for p in params],
                         [matrix_view_shape(p.shape, num_heads=group.get("num_heads"))
                          for p in params]))

    def elementwise(foreach: bool) -> None:
        for params, grads, bufs, views in work:
            muon_update(params, grads, bufs, views, lr=1e-6, weight_decay=0.1, momentum=0.95,
                        nesterov=True, update_scale="match_rms_adamw", orthogonalize=list,
                        foreach=foreach)

    repeats = 2 if args.quick else 5
    step = interleaved({n: o.step for n, o in optimizers.items()}, repeats=repeats)
    alone = interleaved({"per-tensor": functools.partial(elementwise, False),
                         "foreach": functools.partial(elementwise, True)},
                        repeats=3 if args.quick else 30)
    rows, results = [], {}
    for what, timings in [("optimizer step (Muon + AdamW)", step),
                          ("Muon elementwise work only (NS = identity)", alone)]:
        base = timings["per-tensor"]
        for t in timings.values():
            # On a busy machine the fastest round is the steadier ratio; both are shown.
            rows.append([what, t.name, f"{t.median * 1e3:.1f}", t.spread(),
                         f"{t.median / base.median:.3f}",
                         f"{min(t.seconds) / min(base.seconds):.3f}"])
        results[what] = {t.name: {"median_s": t.median, "min_s": min(t.seconds)}
                         for t in timings.values()}
    n_muon = sum(len(g["params"]) for g in optimizers["foreach"].param_groups if g["use_muon"])
    print_table(f"Muon elementwise work: foreach vs per-tensor, `small`-like parameter set "
                f"({n_muon} Muon tensors{', quick' if args.quick else ''})",
                ["measured", "variant", "median ms", "min–max ms", "× per-tensor (median)",
                 "× (min)"], rows)
    return results


def _distributed_worker(rank: int, world: int, init_file: str, out: str, quick: bool) -> None:
    """One rank: DDP-style replicated parameters, distributed Muon vs every rank's own NS."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        optimizers = {
            "every rank runs all NS (distributed=False)": MuonAdamW(
                small_like_groups(quick), lr=0.02, distributed=False),
            "distributed Muon (each matrix on one rank)": MuonAdamW(
                small_like_groups(quick), lr=0.02, distributed=True),
        }

        def step(opt: MuonAdamW) -> None:
            opt.step()
            dist.barrier()  # a step ends when the slowest rank is done

        timings = interleaved({n: functools.partial(step, o) for n, o in optimizers.items()},
                              repeats=2 if quick else 5)
        if rank == 0:
            Path(out).write_text(json.dumps({n: t.seconds for n, t in timings.items()}))
    finally:
        dist.destroy_process_group()


def bench_distributed(args: argparse.Namespace) -> dict[str, object]:
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        mp.spawn(_distributed_worker, args=(world, str(Path(tmp) / "init"), str(out), args.quick),
                 nprocs=world)
        seconds = json.loads(out.read_text())
    medians = {n: statistics.median(s) for n, s in seconds.items()}
    base = next(iter(medians.values()))
    fastest = {n: min(s) for n, s in seconds.items()}
    rows = [[n, f"{m * 1e3:.1f}", f"{fastest[n] * 1e3:.1f}–{max(seconds[n]) * 1e3:.1f}",
             f"{m / base:.3f}", f"{fastest[n] / next(iter(fastest.values())):.3f}"]
            for n, m in medians.items()]
    print_table(f"Optimizer step on {world} CPU ranks (gloo, 1 thread each), DDP-style "
                f"replicated `small`-like parameters{' (quick)' if args.quick else ''}",
                ["candidate", "median ms", "min–max ms", "× every rank (median)", "× (min)"],
                rows)
    return {"world": world, "median_s": medians, "min_s": fastest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--only", choices=["step", "floor", "gram", "accuracy", "throughput",
                                           "batching", "foreach", "distributed"])
    args = parser.parse_args()
    torch.manual_seed(0)
    benches = {"step": bench_step, "floor": bench_floor, "gram": bench_gram,
               "accuracy": bench_ns_accuracy,
               "throughput": bench_throughput, "batching": bench_batching,
               "foreach": bench_foreach, "distributed": bench_distributed}
    results = {name: fn(args) for name, fn in benches.items() if args.only in (None, name)}
    write_json(args.json, results)


if __name__ == "__main__":
    main()
