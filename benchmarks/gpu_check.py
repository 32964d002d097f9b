"""GPU readiness check: NS correctness per dtype, optimizer and NS speed, bf16 training steps.

Run on a CUDA machine: ``python benchmarks/gpu_check.py [--json PATH]`` (about a minute on
one modern GPU). On a machine without CUDA it says so, runs a small CPU smoke of the same
code paths and exits 0, so CI keeps the script from rotting.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3_optim import MuonAdamW, build_parameter_groups, newton_schulz

# Dense bf16 tensor-core peak (no sparsity), TFLOP/s, from the vendors' data sheets.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 70.0}


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


def check_ns(device: torch.device, small: bool) -> dict[str, Any]:
    """Relative error of NS in each dtype against the fp64 iteration, and max |σ − 1|."""
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(64, 256), (3, 32, 96)] if small else [(1024, 4096), (4096, 1024), (16, 256, 1024)]
    out: dict[str, Any] = {}
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
            print(f"NS {shape} {coefficients}: "
                  + ", ".join(f"{k}={v:.2e}" for k, v in row.items()))
    return out


def ns_throughput(device: torch.device, small: bool) -> dict[str, Any]:
    sizes = [(256, 256)] if small else [(4096, 4096), (2048, 8192), (1024, 4096)]
    out = {}
    for m, n in sizes:
        flops = 5 * (4 * m * m * n + 2 * m**3)
        G = torch.randn(m, n, device=device)
        A, B = torch.randn(m, m, device=device), torch.randn(m, n, device=device)
        row = {}
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            t_ns = cuda_time(lambda dt=dtype, G=G: newton_schulz(G, dtype=dt), 5)
            a, b = A.to(dtype), B.to(dtype)
            t_mm = cuda_time(lambda a=a, b=b: a @ b, 10)
            row[name] = {"ns_tflops": flops / t_ns / 1e12,
                         "matmul_tflops": 2 * m * m * n / t_mm / 1e12}
        out[f"{m}x{n}"] = row
        print(f"NS throughput {m}x{n}: " + ", ".join(
            f"{k} NS {v['ns_tflops']:.1f} vs matmul {v['matmul_tflops']:.1f} TFLOP/s"
            for k, v in row.items()))
    return out


def optimizer_step(device: torch.device, small: bool) -> dict[str, Any]:
    d, layers, vocab = (128, 2, 1024) if small else (1024, 12, 32768)

    def params() -> dict[str, torch.Tensor]:
        shapes = {"embed": (vocab, d)}
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

    def split(ps: dict[str, torch.Tensor]) -> tuple[list, list]:
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
        print(f"optimizer step d={d} x{layers}: {name}: {t * 1e3:.2f} ms ({t / base:.2f}x torch)")
    return {name: {"seconds": t, "vs_torch": t / base} for name, t in results.items()}


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        hidden = 8 * d // 3
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _GPT(nn.Module):
    """A plain decoder for the bf16 step check (k3-model's presets take over when present)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.norm(h))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(),
                                                            targets.flatten())
        return logits, loss


def bf16_training(device: torch.device, small: bool) -> dict[str, Any]:
    vocab, d, layers, heads, batch, seq = ((256, 128, 2, 4, 4, 64) if small
                                           else (32768, 1024, 8, 8, 16, 1024))
    torch.manual_seed(0)
    model = _GPT(vocab, d, layers, heads).to(device)
    opt = MuonAdamW(build_parameter_groups(model), lr=3e-3)
    n_params = sum(p.numel() for p in model.parameters())
    matmul_params = n_params - model.embed.weight.numel()
    x = torch.randint(0, vocab, (batch, seq + 1), device=device)
    inputs, targets = x[:, :-1], x[:, 1:]
    losses = []

    def fwd_bwd() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss = model(inputs, targets)
        loss.backward()
        losses.append(loss.detach())  # read once at the end: no host sync per step

    def step() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    t_step = cuda_time(step, 10, warmup=0)
    t_fb = cuda_time(lambda: (fwd_bwd(), opt.zero_grad(set_to_none=True)), 5, warmup=0)
    assert all(p.dtype == torch.float32 for p in model.parameters()), "masters must stay fp32"
    losses = [float(v) for v in losses]
    tokens = batch * seq
    flops = 6 * matmul_params * tokens + 12 * layers * d * seq * tokens / 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    mfu = flops / t_step / (peak * 1e12) if peak else None
    finite = all(math.isfinite(v) for v in losses)
    result = {"params": n_params, "step_s": t_step, "optimizer_share": max(0.0, 1 - t_fb / t_step),
              "tokens_per_s": tokens / t_step, "mfu": mfu, "loss_first": losses[0],
              "loss_last": losses[-1], "losses_finite": finite}
    print(f"bf16 training ({n_params / 1e6:.1f}M params, {batch}x{seq}): "
          f"{t_step * 1e3:.1f} ms/step, {tokens / t_step:,.0f} tok/s, "
          f"optimizer {result['optimizer_share']:.1%} of the step, "
          f"MFU {'unknown device' if mfu is None else f'{mfu:.1%}'}, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return result


def preset_training(device: torch.device, small: bool) -> dict[str, Any]:
    """bf16-autocast steps of k3-model's ``small`` preset (``tiny`` for the CPU smoke run),
    with QK-Clip observing and applying and the MoE balancer active, as the trainer runs it."""
    from k3_model import K3Model, flops_per_token, preset
    from k3_qkclip import QKClip, QKClipPolicy

    name, batch, seq = ("tiny", 2, 32) if small else ("small", 16, 1024)
    torch.manual_seed(0)
    model = K3Model(preset(name)).to(device)
    opt = MuonAdamW(build_parameter_groups(model, per_head=model.muon_per_head()), lr=3e-3)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq + 1), device=device)
    losses: list[torch.Tensor] = []
    opt_time: list[float] = []
    with QKClip(model, QKClipPolicy(tau=100.0)) as qk:

        def step() -> None:
            qk.reset()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = model(x[:, :-1], targets=x[:, 1:])
            loss.backward()
            losses.append(loss.detach())
            qk.validate()
            opt_time.append(cuda_time(opt.step, 1, warmup=0))
            qk.apply()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        opt_time.clear()
        t_step = cuda_time(step, 5, warmup=0)
    assert all(p.dtype == torch.float32 for p in model.parameters()), "masters must stay fp32"
    values = [float(v) for v in losses]
    tokens = batch * seq
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)
    flops = flops_per_token(model.config, seq) * tokens
    mfu = flops / t_step / (peak * 1e12) if peak else None
    share = sorted(opt_time)[len(opt_time) // 2] / t_step
    print(f"k3-model {name} preset, bf16 autocast + QK-Clip + MoE ({batch}x{seq}): "
          f"{t_step * 1e3:.1f} ms/step, {tokens / t_step:,.0f} tok/s, optimizer {share:.1%}, "
          f"MFU {'unknown device' if mfu is None else f'{mfu:.1%}'}, "
          f"loss {values[0]:.3f} -> {values[-1]:.3f}, finite {all(map(math.isfinite, values))}")
    return {"preset": name, "step_s": t_step, "tokens_per_s": tokens / t_step, "mfu": mfu,
            "optimizer_share": share, "losses": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the results to this JSON file")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        print("CUDA is not available: skipping the CUDA checks; running a small CPU smoke run")
    results: dict[str, Any] = {"device": str(device), "torch": torch.__version__}
    failures = 0
    for name, fn in (("ns_correctness", check_ns), ("ns_throughput", ns_throughput),
                     ("optimizer_step", optimizer_step), ("bf16_training", bf16_training),
                     ("preset_training", preset_training)):
        try:
            results[name] = fn(device, not cuda)
        except Exception:  # report every section, then fail at the end
            failures += 1
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc(limit=3)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
