"""GPU check: NS accuracy and speed, the optimizer step, KDA kernels, a ~1B model's MFU.

Run on a CUDA machine (sized for under 6 minutes on one H200; see ``--time-limit``)::

    python benchmarks/gpu_check.py --json results/gpu.json --markdown results/gpu.md

Sections (``--sections`` picks a subset, in this order): ``ns_correctness`` (NS error per
dtype against fp64), ``ns_throughput`` (bf16 NS TFLOP/s against a bf16 matmul; goal ≥ 0.9
at 4096²), ``optimizer_step`` (MuonAdamW vs torch's Muon+AdamW), ``kda`` (our chunk_kda
vs flash-linear-attention's kernel: agreement, forward and forward+backward time),
``documents`` (documents kept apart on the device), ``cp`` (context parallelism: KDA's
state passing over 2, 4, 8 slices in one process against the whole sequence, fp32, and
against fla's kernel; one slice's peak memory and time against the whole sequence; with
2 or more GPUs the ``small`` model under context parallelism over NCCL against one
process, and flash-linear-attention's CP kernel against ours where ``fla.ops.cp``
imports; ``gpu_check_cp.py``),
``decode`` (generation with the cache: cached logits against the full forward in fp32,
then milliseconds per decoding step eager, replayed from a CUDA graph on a static cache,
and recomputing the context, ``small`` in bf16 at contexts 1024 and 4096, batch 1 and 8;
fla's fused recurrent kernel when installed; eager steps checked for host syncs), and
``train`` (the ``base`` hybrid preset, ~1 B parameters, bf16 autocast, regionally compiled
then eager: tokens/s, MFU against the dense bf16 peak, peak memory), and
``expert_parallel`` (with 2 or more GPUs: FSDP2 against FSDP2 with the experts split over
every GPU, at equal global batch, over NCCL: step time and the expert bytes each rank
sends per step; skipped with one GPU), ``pipeline`` (with 2 or more GPUs: the ``small``
preset at ``--pipeline-parallel 2``, one stage per GPU, against one process at the same
batch and microbatches: first-step fp32 loss agreement, bf16 step time against the ideal
``p·m/(m+p−1)``, peak memory per rank; ``gpu_check_pp.py``), and ``checkpoint`` (the
training stall per checkpoint, synchronous against ``async_checkpoint``, tiny and small in
bf16: the stall, the time training was blocked, the write's time and the pinned memory
the snapshot holds;
target: background ≤ 0.15 × synchronous). Results, dated, are
written after every measurement, so a run cut short still leaves its numbers; sections
that would not fit in ``--time-limit`` are skipped and say so.

Without CUDA (or with ``--smoke``) every section runs at tiny sizes (well under a minute
on a CPU core; no compile) and exits 0, so CI keeps the script from rotting. The NS and
optimizer sections need only k3-optim; ``kda`` and ``train`` need k3-model and are skipped
with a message without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from k3_optim import MuonAdamW, newton_schulz

# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, from the vendors' data sheets; a copy
# of k3_trainer.observe.window.PEAK_TFLOPS["bf16"], so this script runs with only k3-optim.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
                    "A10G": 70.0, "RTX 4090": 165.0}
SECTIONS = ("ns_correctness", "ns_throughput", "optimizer_step", "kda", "documents", "cp",
            "decode", "train", "expert_parallel", "pipeline", "checkpoint")
NEEDS_K3_MODEL = ("kda", "documents", "cp", "decode", "train", "expert_parallel", "pipeline",
                  "checkpoint")
TRAIN_RESERVE_S = 200.0  # what earlier sections leave for ``train`` when it is selected
MFU_GOAL, NS_GOAL = 0.40, 0.90


def cuda_time(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` measured with CUDA events (CPU wall clock without CUDA)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@dataclass
class Context:
    """What every section gets: device, size, the clock, and a way to save as it goes."""

    device: torch.device
    smoke: bool
    deadline: float
    options: dict[str, Any]
    results: dict[str, Any]
    paths: tuple[Path | None, Path | None]
    start: float = field(default_factory=time.perf_counter)
    reserve: float = 0.0  # seconds the current section must leave for later ones

    def has(self, seconds: float) -> bool:
        """Whether ``seconds`` more fit before the deadline, after the reserve."""
        return self.deadline - time.perf_counter() - self.reserve >= seconds

    def log(self, message: str) -> None:
        now = datetime.now(timezone.utc).strftime("%H:%M:%S")
        print(f"[{now} +{time.perf_counter() - self.start:5.1f}s] {message}", flush=True)

    def time(self, fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
        return cuda_time(fn, repeats, warmup)

    def save(self) -> None:
        json_path, md_path = self.paths
        if json_path:
            json_path.write_text(json.dumps(self.results, indent=2, default=str))
        if md_path:
            md_path.write_text(markdown(self.results))


def peak_bf16_tflops(device: torch.device) -> float | None:
    """The table's dense bf16 peak for this device; None off CUDA or for an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def check_ns(ctx: Context, out: dict[str, Any]) -> None:
    """Relative error of NS in each dtype against the fp64 iteration, and max |σ − 1|."""
    torch.backends.cuda.matmul.allow_tf32 = False
    device = ctx.device
    shapes = [(64, 256), (3, 32, 96)] if ctx.smoke else [(1024, 4096), (4096, 1024),
                                                         (16, 256, 1024)]
    for shape in shapes:
        G = torch.randn(*shape, dtype=torch.float64, device=device)
        for coefficients in ("jordan", "polar_express"):
            ref = newton_schulz(G, coefficients=coefficients, dtype="fp64")
            cpu = newton_schulz(G.cpu(), coefficients=coefficients, dtype="fp64")
            row = {"fp64_device_vs_cpu": float((ref.cpu() - cpu).norm() / cpu.norm())}
            for dtype in ("bf16", "fp32", "fp64"):
                o = newton_schulz(G.float(), coefficients=coefficients, dtype=dtype).double()
                row[dtype] = float((o - ref).norm() / ref.norm())
            s = torch.linalg.svdvals(ref.reshape(-1, *ref.shape[-2:])[0])
            row["max_abs_sigma_minus_1_fp64"] = float((s - 1).abs().max())
            out[f"{'x'.join(map(str, shape))}/{coefficients}"] = row
            ctx.log(f"NS {shape} {coefficients}: "
                    + ", ".join(f"{k}={v:.2e}" for k, v in row.items()))
    ctx.save()


def ns_throughput(ctx: Context, out: dict[str, Any]) -> None:
    """NS TFLOP/s against a plain matmul of the same dtype (5 steps: 5·(4m²n + 2m³) FLOPs)."""
    device = ctx.device
    sizes = [(256, 256)] if ctx.smoke else [(4096, 4096), (2048, 8192), (1024, 4096)]
    for m, n in sizes:
        flops = 5 * (4 * m * m * n + 2 * m**3)
        G = torch.randn(m, n, device=device)
        A, B = torch.randn(m, m, device=device), torch.randn(m, n, device=device)
        row = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            t_ns = cuda_time(lambda dt=dtype, G=G: newton_schulz(G, dtype=dt), 5)
            a, b = A.to(dtype), B.to(dtype)
            t_mm = cuda_time(lambda a=a, b=b: a @ b, 10)
            ns, mm = flops / t_ns / 1e12, 2 * m * m * n / t_mm / 1e12
            row[name] = {"ns_tflops": ns, "matmul_tflops": mm, "ratio": ns / mm}
        out[f"{m}x{n}"] = row
        ctx.save()
        ctx.log(f"NS throughput {m}x{n}: " + ", ".join(
            f"{k} NS {v['ns_tflops']:.1f} vs matmul {v['matmul_tflops']:.1f} TFLOP/s "
            f"({v['ratio']:.2f})" for k, v in row.items()))
    if "4096x4096" in out:
        out["goal"] = {"bf16_ns_over_matmul_4096": out["4096x4096"]["bf16"]["ratio"],
                       "target": NS_GOAL}


def optimizer_step(ctx: Context, out: dict[str, Any]) -> None:
    """One step of MuonAdamW vs torch's Muon + AdamW on a GPT-shaped parameter set."""
    device = ctx.device
    d, layers, vocab = (128, 2, 1024) if ctx.smoke else (1024, 12, 32768)

    def params() -> dict[str, torch.Tensor]:
        shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, d)}
        for i in range(layers):
            shapes |= {f"{i}.q": (d, d), f"{i}.k": (d, d), f"{i}.v": (d, d), f"{i}.o": (d, d),
                       f"{i}.gate": (4 * d, d), f"{i}.up": (4 * d, d), f"{i}.down": (d, 4 * d),
                       f"{i}.norm": (d,)}
        ps = {}
        for name, shape in shapes.items():
            p = torch.randn(*shape, device=device).mul_(0.02).requires_grad_()
            p.grad = torch.randn_like(p)
            ps[name] = p
        return ps

    def split(ps: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        is_hidden = {n: p.ndim == 2 and n != "embed" for n, p in ps.items()}
        return ([p for n, p in ps.items() if is_hidden[n]],
                [p for n, p in ps.items() if not is_hidden[n]])

    hidden, rest = split(params())
    t_muon = torch.optim.Muon(hidden, lr=0.02, adjust_lr_fn="match_rms_adamw")
    t_adam = torch.optim.AdamW(rest, lr=0.02, foreach=True)
    results = {"torch Muon+AdamW (bf16 NS)": cuda_time(lambda: (t_muon.step(), t_adam.step()), 5)}
    for ns_dtype in ("auto", "fp32"):
        h, r = split(params())
        ours = MuonAdamW([{"params": h, "use_muon": True}, {"params": r, "use_muon": False}],
                         lr=0.02, ns_dtype=ns_dtype)
        results[f"MuonAdamW ns_dtype={ns_dtype}"] = cuda_time(ours.step, 5)
    base = results["torch Muon+AdamW (bf16 NS)"]
    for name, t in results.items():
        out[name] = {"ms": t * 1e3, "vs_torch": t / base}
        ctx.log(f"optimizer step d={d} x{layers}: {name}: {t * 1e3:.2f} ms "
                f"({t / base:.2f}x torch)")
    out["shape"] = f"d={d}, {layers} layers, vocab {vocab}"
    ctx.save()


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "n/a"
    return format(value, spec) if isinstance(value, int | float) else str(value)


def markdown(results: dict[str, Any]) -> str:
    """The headline figures as a Markdown table (the JSON has everything)."""
    rows: list[tuple[str, str, str]] = []
    for key, row in results.get("ns_correctness", {}).items():
        if isinstance(row, dict) and "bf16" in row:
            rows.append((f"NS rel. error vs fp64, {key}", "bf16 {} / fp32 {}".format(
                _fmt(row["bf16"], ".1e"), _fmt(row["fp32"], ".1e")), ""))
    for key, row in results.get("ns_throughput", {}).items():
        if isinstance(row, dict) and "bf16" in row:
            b = row["bf16"]
            rows.append((f"NS bf16 TFLOP/s vs matmul, {key}", f"{b['ns_tflops']:.3g} / "
                         f"{b['matmul_tflops']:.3g} = {b['ratio']:.2f}",
                         f"≥ {NS_GOAL}" if key == "4096x4096" else ""))
    for key, row in results.get("optimizer_step", {}).items():
        if isinstance(row, dict) and "ms" in row:
            rows.append((f"optimizer step, {key}", f"{row['ms']:.2f} ms "
                         f"({row['vs_torch']:.2f}x torch)", ""))
    kda = results.get("kda", {})
    for name, row in kda.get("agreement", {}).items():
        if isinstance(row, dict):
            worst = max((v["max_rel"] for v in row.values() if isinstance(v, dict)), default=0)
            figure = (f"o rel {row['o']['max_rel']:.1e}, worst of o and grads rel {worst:.1e}"
                      if "o" in row else str(row.get("skipped")))
            rows.append((f"KDA {name} vs ours-fp32 ({kda['agreement']['shape']})", figure, ""))
    if "fla" in kda:
        rows.append(("KDA fla", str(kda["fla"]), ""))
    for case, row in kda.get("timings", {}).items():
        figures = ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in row.items())
        rows.append((f"KDA {case}", figures, ""))
    documents = results.get("documents", {})
    if "agreement_fp32_max_rel" in documents:
        rows.append((f"documents apart (KDA {documents.get('fla')}): masked vs each alone, fp32",
                     f"max rel {documents['agreement_fp32_max_rel']:.1e}", "≤ 1e-5"))
        rows.append(("documents apart: training step masked ÷ plain, bf16",
                     f"{documents['masked_over_plain']:.2f}×", ""))
    cp = results.get("cp", {})
    for slices, row in cp.get("agreement_fp32", {}).items():
        rows.append((f"cp: KDA over {slices} vs whole ({cp['shape']}), fp32",
                     f"o rel {row['o']:.1e}, worst grad rel {row['grads']:.1e}", "≤ 1e-5"))
    if isinstance(cp.get("fla"), dict):
        rows.append(("cp: KDA over 4 slices (ours) vs fla whole, bf16",
                     ", ".join(f"{k} {v:.1e}" for k, v in cp["fla"].items()), ""))
    for case, row in cp.get("slice_cost_bf16", {}).items():
        memory = "" if row["peak_bytes"] is None else f", peak {row['peak_bytes'] / 2**20:,.0f} MiB"
        rows.append((f"cp: KDA {case} ({cp['shape']}), bf16 fwd+bwd",
                     f"{row['ms']:.1f} ms{memory}", ""))
    model_nccl = cp.get("model_nccl", {})
    if "model_loss_rel" in model_nccl:
        rows.append((f"cp: small over {model_nccl['world']} GPUs (NCCL) vs one process, fp32",
                     f"loss rel {model_nccl['model_loss_rel']:.1e}, grad rel "
                     f"{model_nccl['model_grad_rel']:.1e}; fla CP: {model_nccl['fla_cp']}",
                     "≤ 1e-5"))
    elif model_nccl:
        rows.append(("cp: model over NCCL", str(model_nccl.get("skipped")
                                                or model_nccl.get("error", "")).splitlines()[-1],
                     ""))
    decode = results.get("decode", {})
    if "agreement_fp32_max_rel" in decode:
        rows.append((f"decode {decode.get('preset', '')}: cached vs full forward, fp32",
                     f"max rel {decode['agreement_fp32_max_rel']:.1e}", "≤ 1e-5"))
    for case, row in decode.get("rows", {}).items():
        figure = (", ".join(f"{k} {_fmt(v, ',.2f') if isinstance(v, float) else v}"
                            for k, v in row.items())
                  if "skipped" not in row else str(row["skipped"]))
        rows.append((f"decode {decode.get('preset', '')} bf16 {case}", figure,
                     "no host sync per step; graphed where capture works"))
    train = results.get("train", {})
    for variant in ("compiled", "eager"):
        r = train.get(variant)
        if not isinstance(r, dict):
            continue
        label = (f"train {train.get('preset')} {variant}, {train.get('batch')}x"
                 f"{train.get('seq')}, KDA {train.get('kda_backend')}")
        if "step_ms" in r:
            memory = r["peak_memory_gib"]
            rows.append((label, f"{r['tokens_per_s']:,.0f} tok/s, MFU {_fmt(r['mfu'], '.1%')}, "
                         f"{r['step_ms']:.0f} ms/step, "
                         + ("" if memory is None else f"peak memory {memory:.1f} GiB, ")
                         + f"warm-up {r['warmup_s']:.0f} s",
                         f"MFU ≥ {MFU_GOAL:.0%}" if variant == "compiled" else ""))
        else:
            rows.append((label, str(r.get("skipped") or r.get("error", "")).splitlines()[-1],
                         ""))
    ep = results.get("expert_parallel", {})
    if "step_ratio_ep_to_fsdp" in ep:
        world = ep["world"]
        rows.append((f"expert parallelism over {world} ranks vs FSDP2, "
                     f"{ep['settings'].get('preset', 'tiny')} with "
                     f"{ep['settings']['model'].get('n_experts')} experts",
                     f"step {ep[f'ep{world}']['step_s'] * 1e3:.0f} vs "
                     f"{ep['ep1']['step_s'] * 1e3:.0f} ms ({ep['step_ratio_ep_to_fsdp']:.3f}×), "
                     f"expert bytes/rank/step {ep['bytes_ratio_ep_to_fsdp']:.3f}×", ""))
    pp = results.get("pipeline", {})
    if "speedup" in pp:
        memory = pp.get("peak_memory_ratio")
        rows.append((f"pipeline: {pp['settings']['preset']} at PP 2 (1F1B, "
                     f"{pp['settings']['microbatches']} microbatches) vs one process",
                     f"first loss fp32 rel diff {pp['first_loss_rel_diff']:.1e}, bf16 step "
                     f"speed-up {pp['speedup']:.2f}× (ideal {pp['ideal_speedup']:.2f}×)"
                     + ("" if memory is None else f", peak memory {memory:.2f}×"), "loss ≤ 1e-6"))
    for preset, row in results.get("checkpoint", {}).items():
        if isinstance(row, dict) and "stall_s" in row:
            rows.append((f"checkpoint stall, {preset}, background vs synchronous",
                         f"{row['stall_s']['async'] * 1e3:.1f} vs "
                         f"{row['stall_s']['sync'] * 1e3:.1f} ms ({row['ratio']:.3f}×), "
                         f"blocked {row['blocked_s']['async'] * 1e3:.1f} vs "
                         f"{row['blocked_s']['sync'] * 1e3:.1f} ms, holds "
                         f"{row['held_bytes'] / 2**20:.0f} MiB of host memory", "≤ 0.15×"))
    for name in SECTIONS:
        section = results.get(name, {})
        if isinstance(section, dict) and ("error" in section or "skipped" in section):
            note = str(section.get("skipped") or section["error"]).strip().splitlines()[-1]
            rows.append((name, note, ""))
    head = (f"GPU check, {results.get('date')}, {results.get('device_name')}, "
            f"torch {results.get('torch')}\n\n| check | figure | goal |\n|---|---|---|\n")
    return head + "".join(f"| {a} | {b} | {c} |\n" for a, b, c in rows)


def _run_section(name: str, ctx: Context) -> bool:
    """Run one section into ``ctx.results[name]``; False when it raised."""
    out: dict[str, Any] = {}
    ctx.results[name] = out
    if name in NEEDS_K3_MODEL:
        if importlib.util.find_spec("k3_model") is None:
            out["skipped"] = "needs k3-model: pip install -e packages/k3-model"
            ctx.log(f"{name}: skipped: {out['skipped']}")
            return True
        import gpu_check_cp  # this script's siblings; they import k3_model in their sections
        import gpu_check_k3
        import gpu_check_pp

        fns: dict[str, Callable[[Context, dict[str, Any]], None]] = {
            "kda": gpu_check_k3.kda,
            "documents": gpu_check_k3.documents,
            "cp": gpu_check_cp.context_parallel,
            "decode": gpu_check_k3.decode,
            "train": lambda c, o: gpu_check_k3.train(c, o, peak_bf16_tflops(c.device)),
            "expert_parallel": gpu_check_k3.expert_parallel,
            "pipeline": gpu_check_pp.pipeline,
            "checkpoint": gpu_check_k3.checkpoint}
    else:
        fns = {"ns_correctness": check_ns, "ns_throughput": ns_throughput,
               "optimizer_step": optimizer_step}
    started = time.perf_counter()
    ctx.log(f"{name}: start")
    try:
        fns[name](ctx, out)
    except Exception:  # report every section, then fail at the end
        traceback.print_exc()
        out["error"] = traceback.format_exc(limit=4)
        return False
    finally:
        out["seconds"] = time.perf_counter() - started
        ctx.save()
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results to this JSON file")
    parser.add_argument("--markdown", type=Path, help="write the summary table here too")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="sections to run (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes even on CUDA (always so without CUDA)")
    parser.add_argument("--time-limit", type=float, default=330.0,
                        help="seconds; parts that would start too late are skipped (330)")
    parser.add_argument("--batch", type=int, default=4, help="train: batch size (4)")
    parser.add_argument("--seq", type=int, default=4096, help="train: sequence length (4096)")
    parser.add_argument("--steps", type=int, default=5, help="train: timed steps (5)")
    parser.add_argument("--checkpointing", choices=("none", "block"), default="none",
                        help="train: activation checkpointing (none)")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="train: eager only")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    smoke = args.smoke or not cuda
    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": str(device),
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "smoke": smoke,
        "time_limit_s": args.time_limit, "sections": args.sections}
    for path in (args.json, args.markdown):
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
    options = {"batch": args.batch, "seq": args.seq, "steps": args.steps,
               "checkpointing": args.checkpointing, "compile": args.compile}
    ctx = Context(device, smoke, time.perf_counter() + args.time_limit, options, results,
                  (args.json, args.markdown))
    ctx.log(f"device {results['device_name']}, torch {torch.__version__}"
            + ("" if not smoke else " (smoke sizes" + ("" if cuda else ", no CUDA") + ")"))
    failures = 0
    selected = [name for name in SECTIONS if name in args.sections]
    for name in selected:
        ctx.reserve = TRAIN_RESERVE_S if "train" in selected and name != "train" else 0.0
        if not smoke and not ctx.has(5):
            results[name] = {"skipped": "time limit"}
            ctx.log(f"{name}: skipped (time limit)")
            continue
        failures += not _run_section(name, ctx)
    ctx.save()
    print("\n" + markdown(results), flush=True)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
