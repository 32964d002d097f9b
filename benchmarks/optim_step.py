"""bench_optim's headline: the whole optimizer step against ``torch.optim.Muon``.

Every set of parameters (the ``small`` preset's, and transformer shapes: square, 4:1, 1:4,
expert stacks) is stepped by ``torch.optim.Muon`` (bf16 Newton–Schulz, its own
coefficients; with ``torch.optim.AdamW(fused=True)`` for the preset's AdamW groups) and
by MuonAdamW built up one gain at a time, all at bf16 and 5 steps, interleaved in one
process: one matrix per call (no batching, the standard iteration, elementwise work one
tensor at a time), then batching by shape, then the Gram iteration, then foreach
elementwise work (MuonAdamW's default at bf16). A plain fp32 loop and MuonAdamW's CPU
default (fp32) stand beside them. torch's optimizer takes 2-D parameters only, so every
baseline gets expert stacks and per-head blocks as separate matrices: the same
Newton–Schulz work on both sides.

The floor: for the ``small`` preset at bf16, each shape bucket's iteration against the
bare matrix products it runs (the same ``bmm`` calls, nothing else), and the step's other
parts (stacking and normalization, Muon's elementwise work, the AdamW half).
"""

from __future__ import annotations

import argparse
import functools
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from common import interleaved, print_table
from k3_optim import MuonAdamW, matrix_view_shape
from k3_optim.muon import muon_update, orthogonalize
from k3_optim.newton_schulz import (
    gram_restarts,
    iterate,
    normalize_into,
    resolve_coefficients,
    resolve_ns_method,
)

# The `small` model preset's optimizer groups (k3_model.preset("small"), 54 M params):
# (shape, count) per group, as K3Model.parameter_groups() routes them.
SMALL_GROUPS: dict[str, tuple[bool, int | None, list[tuple[tuple[int, ...], int]]]] = {
    "muon": (True, None, [
        ((64, 384), 6), ((384, 64), 6), ((6, 384), 6), ((384, 384), 16), ((1024, 384), 2),
        ((384, 1024), 1), ((16, 384), 7), ((192, 384), 7), ((16, 256, 192), 14),
        ((16, 192, 256), 7), ((384, 192), 7), ((256, 384), 14), ((384, 256), 7),
        ((128, 384), 2)]),
    "muon_heads6": (True, 6, [((384, 384), 20), ((576, 96), 2)]),
    "adamw": (False, None, [((32768, 384), 2), ((384, 1, 4), 18)]),
    "adamw_no_decay": (False, None, [((384,), 55), ((6,), 6), ((64,), 6), ((192,), 7),
                                     ((96,), 2)]),
}
GroupSpec = dict[str, tuple[bool, int | None, list[tuple[tuple[int, ...], int]]]]


def shape_sets(quick: bool) -> dict[str, GroupSpec]:
    """The parameter sets of the step table (``quick``: smaller, for the CI smoke run)."""
    d, e = (128, 8) if quick else (512, 32)
    small = {name: (muon, heads, [((4096, *s[1:]) if s[0] == 32768 else s, max(1, c // 4))
                                  for s, c in shapes])
             for name, (muon, heads, shapes) in SMALL_GROUPS.items()} if quick else SMALL_GROUPS
    return {
        "`small` preset (Muon + AdamW)": small,
        f"square: 8 × {2 * d}²": {"muon": (True, None, [((2 * d, 2 * d), 8)])},
        f"4:1: 4 × {4 * d}×{d}": {"muon": (True, None, [((4 * d, d), 4)])},
        f"1:4: 4 × {d}×{4 * d}": {"muon": (True, None, [((d, 4 * d), 4)])},
        f"expert stacks: ({e}, {d // 4}, {d}) × 2 + ({e}, {d}, {d // 4})": {
            "muon": (True, None, [((e, d // 4, d), 2), ((e, d, d // 4), 1)])},
    }


def make_groups(spec: GroupSpec, seed: int = 0) -> list[dict[str, Any]]:
    """Param groups of ``spec``, each parameter with a fixed random gradient."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for name, (use_muon, heads, shapes) in spec.items():
        params = []
        for shape, count in shapes:
            for _ in range(count):
                p = torch.randn(*shape, generator=gen).mul_(0.02).requires_grad_()
                p.grad = torch.randn(*shape, generator=gen)
                params.append(p)
        group: dict[str, Any] = {"params": params, "use_muon": use_muon, "name": name}
        if heads:
            group["num_heads"] = heads
        if name == "adamw_no_decay":
            group["weight_decay"] = 0.0
        groups.append(group)
    return groups


def split_matrices(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Every matrix Muon orthogonalizes in ``groups`` (experts, per-head blocks) as its own
    2-D leaf parameter with its gradient: what ``torch.optim.Muon`` can take."""
    matrices = []
    for group in groups:
        if not group["use_muon"]:
            continue
        for p in group["params"]:
            batch, rows, cols = matrix_view_shape(p.shape, num_heads=group.get("num_heads"))
            for w, g in zip(p.detach().reshape(batch, rows, cols),
                            p.grad.reshape(batch, rows, cols)):
                q = w.clone().requires_grad_()
                q.grad = g.clone()
                matrices.append(q)
    return matrices


HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def candidates(spec: GroupSpec, *, variants: bool) -> dict[str, Callable[[], object]]:
    """name → one optimizer step, each on its own copy of the parameters."""
    Step = Callable[[], object]

    def with_adamw(step: Step, groups: list[dict[str, Any]]) -> Step:
        rest = [g for g in groups if not g["use_muon"]]
        if not rest:
            return step
        adamw = torch.optim.AdamW(
            [{"params": g["params"], "weight_decay": g.get("weight_decay", 0.1)} for g in rest],
            lr=HP["lr"], betas=(0.9, 0.95), fused=True)
        return lambda: (step(), adamw.step())

    def one_matrix_per_call(ns_dtype: str) -> Step:
        groups = make_groups(spec)
        opt = MuonAdamW([{"params": [m], "use_muon": True} for m in split_matrices(groups)],
                        ns_dtype=ns_dtype, ns_method="standard", **HP)
        opt._foreach = False  # the private switch: elementwise work one tensor at a time
        return with_adamw(opt.step, groups)

    def ours(foreach: bool = True, **options: Any) -> Step:
        opt = MuonAdamW(make_groups(spec), fused=True, **HP, **options)
        opt._foreach = foreach
        return opt.step

    torch_groups = make_groups(spec)
    torch_muon = torch.optim.Muon(split_matrices(torch_groups), adjust_lr_fn="match_rms_adamw",
                                  **HP)
    cases = {
        "torch.optim.Muon (bf16)": with_adamw(torch_muon.step, torch_groups),
        "plain fp32 loop (one matrix per call)": one_matrix_per_call("fp32"),
        "MuonAdamW bf16, one matrix per call, standard NS, per-tensor": one_matrix_per_call(
            "bf16"),
        "+ batching by shape": ours(ns_dtype="bf16", ns_method="standard", foreach=False),
        "+ Gram NS where it pays (ns_method=auto)": ours(ns_dtype="bf16", foreach=False),
        "+ foreach elementwise = MuonAdamW(ns_dtype=bf16)": ours(ns_dtype="bf16"),
        "MuonAdamW() default (auto → fp32 on CPU)": ours(),
    }
    if variants:
        cases["MuonAdamW(ns_dtype=bf16) + NorMuon + cautious WD"] = ours(
            ns_dtype="bf16", normuon=True, cautious_weight_decay=True)
    return cases


def bench_step(args: argparse.Namespace) -> dict[str, object]:
    results: dict[str, object] = {}
    summary = []
    for index, (title, spec) in enumerate(shape_sets(args.quick).items()):
        cases = candidates(spec, variants=index == 0)
        timings = interleaved(cases, repeats=1 if args.quick else 3,
                              warmup=0 if args.quick else 1)
        base = timings["torch.optim.Muon (bf16)"]
        rows = [[t.name, f"{t.median * 1e3:.1f}", t.spread(), f"{t.median / base.median:.3f}",
                 f"{min(t.seconds) / min(base.seconds):.3f}"] for t in timings.values()]
        print_table(f"Optimizer step at bf16, 5 NS steps: {title}",
                    ["candidate", "median ms", "min–max ms", "× torch (median)", "× torch (min)"],
                    rows)
        results[title] = {t.name: {"median_s": t.median, "seconds": t.seconds}
                          for t in timings.values()}
        ours = timings["+ foreach elementwise = MuonAdamW(ns_dtype=bf16)"]
        default = timings["MuonAdamW() default (auto → fp32 on CPU)"]
        summary.append([title, f"{base.median * 1e3:.1f}", f"{ours.median * 1e3:.1f}",
                        f"{ours.median / base.median:.3f}", f"{default.median / base.median:.3f}"])
    print_table("Optimizer step against torch.optim.Muon (bf16, 5 steps), per parameter set",
                ["parameters", "torch ms", "MuonAdamW(ns_dtype=bf16) ms", "× torch",
                 "MuonAdamW() default × torch"], summary)
    return results


def _bare_matmuls(X: torch.Tensor, steps: int, method: str) -> torch.Tensor:
    """The matrix products of one iteration (same shapes, same count), nothing else."""
    if X.shape[-2] > X.shape[-1]:  # tall: the iteration's products are those of Xᵀ's
        return _bare_matmuls(X.mT, steps, method)
    A = torch.bmm(X, X.mT)
    if method == "standard":
        for _ in range(steps):
            A = torch.bmm(X, X.mT)
            out = torch.bmm(torch.bmm(A, A), X)
        return out
    restarts, Q = gram_restarts(steps), None
    for i in range(steps):
        if i in restarts and Q is not None:
            A = torch.bmm(torch.bmm(Q, X), X.mT)
            Q = None
        H = torch.bmm(A, A)
        Q = H if Q is None else torch.bmm(H, Q)
        if i + 1 < steps and i + 1 not in restarts:
            A = torch.bmm(H, torch.bmm(A, H))
    return torch.bmm(Q, X)


def bench_floor(args: argparse.Namespace) -> dict[str, object]:
    """Where the `small` preset's bf16 step goes, against the bare matrix products."""
    spec = shape_sets(args.quick)["`small` preset (Muon + AdamW)"]
    groups = make_groups(spec)
    per_step, _ = resolve_coefficients("jordan", 5)
    # As MuonAdamW buckets them: by shape, orientation included (a tall stack is iterated
    # on its right side, never transposed).
    buckets: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    updates, views = [], []
    for group in groups:
        if group["use_muon"]:
            for p in group["params"]:
                view = matrix_view_shape(p.shape, num_heads=group.get("num_heads"))
                batch, rows, cols = view
                buckets[(rows, cols)].append(p.grad.reshape(batch, rows, cols))
                updates.append(p.grad)
                views.append(view)
    cases: dict[str, Callable[[], object]] = {}
    info = {}
    for (rows, cols), mats in sorted(buckets.items(), key=lambda kv: -sum(
            m.shape[0] for m in kv[1]) * min(kv[0]) ** 2 * max(kv[0])):
        stack = torch.empty(sum(m.shape[0] for m in mats), rows, cols, dtype=torch.bfloat16)
        normalize_into(stack, torch.cat(mats), norm_factor=1.0, eps=1e-7)
        method = resolve_ns_method("auto", rows, cols)
        label = f"{stack.shape[0]} × {rows}×{cols}"
        info[label] = method
        cases[f"{label}: iteration"] = functools.partial(iterate, stack, per_step, method=method)
        cases[f"{label}: bare products"] = functools.partial(_bare_matmuls, stack, 5, method)
    cases["all buckets: stack, normalize, iterate, unstack"] = functools.partial(
        orthogonalize, updates, views, ns_steps=5, ns_dtype="bf16", ns_coefficients="jordan",
        ns_eps=1e-7, ns_method="auto")
    muon = [(list(g["params"]), [torch.zeros_like(p) for p in g["params"]],
             [matrix_view_shape(p.shape, num_heads=g.get("num_heads")) for p in g["params"]])
            for g in groups if g["use_muon"]]

    def elementwise() -> None:
        with torch.no_grad():
            for params, bufs, group_views in muon:
                muon_update([p.detach() for p in params], [p.grad for p in params], bufs,
                            group_views, lr=1e-6, weight_decay=0.1, momentum=0.95,
                            nesterov=True, update_scale="match_rms_adamw", orthogonalize=list)

    cases["Muon elementwise work (momentum, Nesterov, decay, add; foreach)"] = elementwise
    adamw = torch.optim.AdamW([{"params": g["params"]} for g in groups if not g["use_muon"]],
                              lr=1e-6, fused=True)
    cases["AdamW half (torch fused)"] = adamw.step
    whole = MuonAdamW(make_groups(spec), ns_dtype="bf16", fused=True, **HP)
    cases["the whole step: MuonAdamW(ns_dtype=bf16)"] = whole.step
    torch_step = candidates(spec, variants=False)["torch.optim.Muon (bf16)"]
    cases["the whole step: torch.optim.Muon (bf16) + fused AdamW"] = torch_step
    timings = interleaved(cases, repeats=1 if args.quick else 5, warmup=0 if args.quick else 1)
    rows, results = [], {}
    iteration = products = 0.0
    for label, method in info.items():
        it, bare = timings[f"{label}: iteration"], timings[f"{label}: bare products"]
        iteration += it.median
        products += bare.median
        rows.append([f"bucket {label} ({method})", f"{it.median * 1e3:.1f}",
                     f"{bare.median * 1e3:.1f}", f"{it.median / bare.median:.2f}"])
        results[label] = {"method": method, "iteration_s": it.median, "products_s": bare.median}
    rows.append(["all iterations", f"{iteration * 1e3:.1f}", f"{products * 1e3:.1f}",
                 f"{iteration / products:.2f}"])
    for name in list(cases)[-5:]:
        rows.append([name, f"{timings[name].median * 1e3:.1f}", "", ""])
        results[name] = timings[name].median
    results["products_s"], results["iterations_s"] = products, iteration
    # The floor: the bare products of every bucket plus the AdamW half (fused), against
    # torch's whole step in the same run.
    floor = products + timings["AdamW half (torch fused)"].median
    torch_s = timings["the whole step: torch.optim.Muon (bf16) + fused AdamW"].median
    ours_s = timings["the whole step: MuonAdamW(ns_dtype=bf16)"].median
    rows.append(["floor: bare products + AdamW half", f"{floor * 1e3:.1f}", "", ""])
    rows.append(["floor × torch's step; MuonAdamW × torch's step", f"{floor / torch_s:.3f}",
                 "", f"{ours_s / torch_s:.3f}"])
    results["floor_over_torch"], results["ours_over_torch"] = floor / torch_s, ours_s / torch_s
    print_table("Where the bf16 step goes, `small` preset (medians; bare products: the same "
                "bmm calls alone)", ["part", "ms", "bare products ms", "× bare"], rows)
    return results
