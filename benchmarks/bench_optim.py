"""k3-optim benchmarks: MuonAdamW vs torch Muon + AdamW, NS per dtype/set, batching.

Run: ``hatch run bench:optim`` (add ``--quick`` for a smoke run, ``--json PATH`` to save).
Every table compares candidates timed interleaved in this one process.
"""

from __future__ import annotations

import argparse

import torch

from common import interleaved, print_table, write_json
from k3_optim import MuonAdamW, newton_schulz


def gpt_like_params(d: int, layers: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The parameter set of a small GPT: 7 hidden matrices per layer, tied embedding, norms."""
    gen = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d), "final_norm.weight": (d,)}
    for i in range(layers):
        shapes |= {
            f"l{i}.q": (d, d), f"l{i}.k": (d, d), f"l{i}.v": (d, d), f"l{i}.o": (d, d),
            f"l{i}.gate": (4 * d, d), f"l{i}.up": (4 * d, d), f"l{i}.down": (d, 4 * d),
            f"l{i}.attn_norm": (d,), f"l{i}.mlp_norm": (d,),
        }
    params = {}
    for name, shape in shapes.items():
        p = torch.randn(*shape, generator=gen).mul_(0.02).requires_grad_()
        p.grad = torch.randn(*shape, generator=gen)
        params[name] = p
    return params


def _split(params: dict[str, torch.Tensor]) -> tuple[list, list, list]:
    hidden = [p for n, p in params.items() if p.ndim == 2 and not n.startswith("embed")]
    table = [params["embed.weight"]]
    vectors = [p for p in params.values() if p.ndim == 1]
    return hidden, table, vectors


def bench_step(args: argparse.Namespace) -> dict[str, object]:
    d, layers = (128, 2) if args.quick else (256, 4)
    hp = dict(lr=0.02, weight_decay=0.1)
    torch_params, bf16_params, default_params = (gpt_like_params(d, layers, 8192) for _ in range(3))

    hidden, table, vectors = _split(torch_params)
    torch_muon = torch.optim.Muon(hidden, momentum=0.95, nesterov=True,
                                  adjust_lr_fn="match_rms_adamw", **hp)
    torch_adamw = torch.optim.AdamW(table + vectors, betas=(0.9, 0.95), foreach=True, **hp)

    def ours(params: dict[str, torch.Tensor], ns_dtype: str) -> MuonAdamW:
        hidden, table, vectors = _split(params)
        return MuonAdamW([{"params": hidden, "use_muon": True},
                          {"params": table, "use_muon": False},
                          {"params": vectors, "use_muon": False, "weight_decay": 0.0}],

                         ns_dtype=ns_dtype, foreach=True, **hp)

    ours_bf16, ours_default = ours(bf16_params, "bf16"), ours(default_params, "auto")
    timings = interleaved(
        {
            "torch Muon + AdamW(foreach) [NS bf16, forced]": lambda: (torch_muon.step(),
                                                                      torch_adamw.step()),
            "MuonAdamW ns_dtype=bf16 (matched)": ours_bf16.step,
            "MuonAdamW default (auto → fp32 on CPU)": ours_default.step,
        },
        repeats=1 if args.quick else 3,
        warmup=0 if args.quick else 1,
    )
    base = next(iter(timings.values()))
    rows = [[t.name, f"{t.median * 1e3:.1f}", t.spread(), f"{t.median / base.median:.3f}"]
            for t in timings.values()]
    n_matrices = len(_split(torch_params)[0])
    print_table(f"Optimizer step, GPT-like d={d}, {layers} layers ({n_matrices} hidden matrices)",
                ["candidate", "median ms", "min–max ms", "× torch"], rows)
    return {t.name: {"median_s": t.median, "seconds": t.seconds} for t in timings.values()}


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
            cases[(coefficients, dtype)] = (
                lambda c=coefficients, dt=dtype: newton_schulz(G, coefficients=c, dtype=dt))
    timings = interleaved({f"{c} {dt}": fn for (c, dt), fn in cases.items()},
                          repeats=1 if args.quick else 3)
    rows, results = [], {}
    for (coefficients, dtype), fn in cases.items():
        out = fn().double()
        s = torch.linalg.svdvals(out)
        gram = out @ out.T - torch.eye(m, dtype=torch.float64)
        rel = float((out - refs[coefficients]).norm() / refs[coefficients].norm())
        t = timings[f"{coefficients} {dtype}"]
        sigma_err, gram_err = float((s - 1).abs().max()), float(gram.norm())
        rows.append([coefficients, dtype, f"{t.median * 1e3:.1f}",
                     f"{_ns_flops(m, n, 5) / t.median / 1e9:.1f}",
                     f"{sigma_err:.3f}", f"{gram_err:.3f}", f"{rel:.1e}"])
        results[f"{coefficients}/{dtype}"] = {"median_s": t.median, "max_abs_sigma_minus_1":
                                               sigma_err, "gram_err": gram_err,
                                               "rel_err_vs_fp64": rel}
    print_table(f"Newton–Schulz, 5 steps on {m}×{n} (Gaussian), per dtype and set",
                ["set", "dtype", "median ms", "GFLOP/s", "max|σ−1|", "‖OOᵀ−I‖_F",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--only", choices=["step", "accuracy", "throughput", "batching"])
    args = parser.parse_args()
    torch.manual_seed(0)
    benches = {"step": bench_step, "accuracy": bench_ns_accuracy,
               "throughput": bench_throughput, "batching": bench_batching}
    results = {name: fn(args) for name, fn in benches.items() if args.only in (None, name)}
    write_json(args.json, results)


if __name__ == "__main__":
    main()
