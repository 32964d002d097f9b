"""The k3-model sections of ``gpu_check.py``: the KDA kernels and a ~1B hybrid model's steps.

Imported by ``gpu_check.py`` only when these sections run, so the NS and optimizer checks
keep working with nothing but k3-optim installed. Every figure lands in the section's
``out`` dict as soon as it is measured, and ``ctx.save()`` writes it, so a run cut short
still leaves numbers.
"""

from __future__ import annotations

import gc
import math
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

FLA_INSTALL = "pip install flash-linear-attention"
GRAD_NAMES = ("q", "k", "v", "g", "beta")


class Context(Protocol):
    """What ``gpu_check.py`` hands each section (see ``gpu_check.Context``)."""

    device: torch.device
    smoke: bool
    options: dict[str, Any]

    def has(self, seconds: float) -> bool: ...
    def save(self) -> None: ...
    def log(self, message: str) -> None: ...
    def time(self, fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float: ...


def _fla() -> tuple[Callable[..., Any] | None, str]:
    """flash-linear-attention's chunked KDA and its version, or None and why not."""
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as error:  # ImportError, or a triton/driver error at import
        return None, f"not importable ({type(error).__name__}: {error}); {FLA_INSTALL}"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return fla_chunk_kda, version("flash-linear-attention")
    except PackageNotFoundError:
        return fla_chunk_kda, "unknown version"


def _kda_inputs(b: int, t: int, h: int, d: int, device: torch.device,
                seed: int = 0) -> list[torch.Tensor]:
    """q, k (L2-normalized), v in bf16; g (K3's range, −5 < g < 0) and β in fp32, as
    ``KimiDeltaAttention`` passes them to the kernel."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q = F.normalize(randn(b, t, h, d), dim=-1).bfloat16()
    k = F.normalize(randn(b, t, h, d), dim=-1).bfloat16()
    v = randn(b, t, h, d).bfloat16()
    g = -5.0 * torch.sigmoid(2.0 * randn(b, t, h, d))
    beta = torch.sigmoid(randn(b, t, h))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _run(kernel: Callable[..., Any], inputs: list[torch.Tensor], grad: torch.Tensor | None
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Output and (with ``grad``) the input gradients of one kernel call."""
    for x in inputs:
        x.grad = None
    o = kernel(*inputs)
    if grad is None:
        return o.detach(), []
    o.backward(grad)
    return o.detach(), [x.grad.detach() for x in inputs]  # type: ignore[union-attr]


def _diff(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    err = float((x.float() - ref.float()).abs().max())
    return {"max_abs": err, "max_rel": err / max(float(ref.abs().max()), 1e-30)}


def kda(ctx: Context, out: dict[str, Any]) -> None:
    """chunk_kda (ours, torch) vs fla's chunked kernel: agreement, forward and fwd+bwd time."""
    from k3_model.kda import chunk_kda

    device, smoke = ctx.device, ctx.smoke
    fla_kernel, fla_note = _fla() if device.type == "cuda" else (None, "CUDA only")
    out["fla"] = fla_note
    if fla_kernel is None:
        ctx.log(f"KDA: fla skipped: {fla_note}")
    h, d, chunk = (2, 16, 64) if smoke else (16, 128, 64)
    cases = [(128, 1), (128, 2)] if smoke else [(4096, 1), (4096, 2), (4096, 4), (16384, 1)]
    scale = d**-0.5
    kernels: dict[str, Callable[..., torch.Tensor]] = {
        "ours": lambda *a: chunk_kda(*a, scale=scale, chunk_size=chunk)[0]}
    if fla_kernel is not None:
        kernels["fla"] = lambda *a: fla_kernel(*a, scale=scale, use_qk_l2norm_in_kernel=False)[0]
    out.update(heads=h, head_dim=d, chunk_size=chunk,
               inputs="q, k, v bf16; g, beta fp32 (as the layer passes them)")

    # Agreement against ours on fp32 copies of the same inputs (fp32 compute either way).
    t0, b0 = cases[0]
    inputs = _kda_inputs(b0, t0, h, d, device)
    grad = torch.randn(b0, t0, h, d, device=device, generator=torch.Generator(
        device=device).manual_seed(1)).bfloat16()
    ref_inputs = [x.detach().float().requires_grad_() for x in inputs]
    ref_o, ref_grads = _run(kernels["ours"], ref_inputs, grad.float())
    agreement: dict[str, Any] = {"shape": f"B={b0} T={t0} H={h} K=V={d}"}
    for name, kernel in kernels.items():
        if not ctx.has(30):
            agreement[name] = {"skipped": "time limit"}
            continue
        started = time.perf_counter()
        o, grads = _run(kernel, inputs, grad)
        diffs = {"o": _diff(o, ref_o)}
        diffs |= {f"d{n}": _diff(gx, gr) for n, gx, gr in zip(GRAD_NAMES, grads, ref_grads)}
        agreement[name] = {"first_call_s": time.perf_counter() - started, **diffs}
        ctx.log(f"KDA agreement {name} vs ours-fp32 ({agreement['shape']}), max abs/rel: "
                + ", ".join(f"{k} {v['max_abs']:.1e}/{v['max_rel']:.1e}"
                            for k, v in diffs.items()))
    out["agreement"] = agreement
    ctx.save()

    repeats = 1 if smoke else 3
    timings: dict[str, Any] = {}
    out["timings"] = timings
    for t, b in cases:
        if not ctx.has(20 if t <= 4096 else 40):
            timings[f"T={t} B={b}"] = {"skipped": "time limit"}
            ctx.log(f"KDA T={t} B={b}: skipped (time limit)")
            continue
        inputs = _kda_inputs(b, t, h, d, device)
        grad = torch.randn_like(inputs[2])
        row: dict[str, float] = {}
        for name, kernel in kernels.items():
            def forward(kernel: Callable[..., Any] = kernel,
                        inputs: list[torch.Tensor] = inputs) -> None:
                with torch.no_grad():
                    kernel(*inputs)

            def forward_backward(kernel: Callable[..., Any] = kernel,
                                 inputs: list[torch.Tensor] = inputs,
                                 grad: torch.Tensor = grad) -> None:
                _run(kernel, inputs, grad)

            row[f"{name}_fwd_ms"] = ctx.time(forward, repeats) * 1e3
            row[f"{name}_fwd_bwd_ms"] = ctx.time(forward_backward, repeats) * 1e3
        if "fla" in kernels:
            row["fla_speedup_fwd"] = row["ours_fwd_ms"] / row["fla_fwd_ms"]
            row["fla_speedup_fwd_bwd"] = row["ours_fwd_bwd_ms"] / row["fla_fwd_bwd_ms"]
        timings[f"T={t} B={b}"] = row
        ctx.save()
        ctx.log(f"KDA T={t} B={b}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _step_times(model: Any, opt: Any, x: torch.Tensor, device: torch.device,
                losses: list[torch.Tensor]) -> tuple[float, float]:
    """One training step; returns (step seconds, optimizer seconds). One sync per step,
    where the trainer's finite-loss check has one anyway."""
    cuda = device.type == "cuda"
    if cuda:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        _, loss = model(x[:, :-1], targets=x[:, 1:])
    loss.backward()
    losses.append(loss.detach())
    mid = time.perf_counter()
    if cuda:
        marks[1].record()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if cuda:
        marks[2].record()
        torch.cuda.synchronize()
        return marks[0].elapsed_time(marks[2]) / 1e3, marks[1].elapsed_time(marks[2]) / 1e3
    end = time.perf_counter()
    return end - start, end - mid


def _train_variant(ctx: Context, config: Any, batch: int, seq: int, compiled: bool,
                   peak_tflops: float | None) -> dict[str, Any]:
    from k3_model import K3Model, flops_per_token
    from k3_optim import MuonAdamW

    device = ctx.device
    _free(device)
    torch.manual_seed(0)
    model = K3Model(config).to(device)
    model.set_activation_checkpointing(ctx.options["checkpointing"])
    if compiled:  # regional compilation, as k3_trainer.compiling.prepare_model does
        for block in model.layers:
            block.compile()
    opt = MuonAdamW(model.parameter_groups(lr=3e-4), lr=3e-4, ns_dtype="auto")
    x = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
    losses: list[torch.Tensor] = []
    warmup, steps = (1, 2) if ctx.smoke else (3, ctx.options["steps"])
    started = time.perf_counter()
    for _ in range(warmup):  # compilation, autotuning, allocator warm-up
        _step_times(model, opt, x, device, losses)
    warmup_s = time.perf_counter() - started
    timed = [_step_times(model, opt, x, device, losses) for _ in range(steps)]
    step_s = sorted(s for s, _ in timed)[len(timed) // 2]
    opt_s = sorted(o for _, o in timed)[len(timed) // 2]
    values = [float(v) for v in losses]
    tokens = batch * seq
    flops = flops_per_token(config, seq)
    result = {
        "warmup_steps": warmup, "warmup_s": warmup_s, "timed_steps": steps,
        "step_ms": step_s * 1e3, "optimizer_ms": opt_s * 1e3,
        "tokens_per_s": tokens / step_s, "model_tflops_per_s": flops * tokens / step_s / 1e12,
        "mfu": flops * tokens / step_s / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_gib": (torch.cuda.max_memory_allocated() / 2**30
                            if device.type == "cuda" else None),
        "loss_first": values[0], "loss_last": values[-1],
        "losses_finite": all(map(math.isfinite, values)),
    }
    del model, opt, x
    if compiled:
        torch._dynamo.reset()
    _free(device)
    return result


def train(ctx: Context, out: dict[str, Any], peak_tflops: float | None) -> None:
    """A ~1B hybrid preset (``base``) in bf16 autocast: compiled per block, then eager."""
    from k3_model import count_parameters, flops_per_token, preset
    from k3_model.kda import fla_available

    device, smoke = ctx.device, ctx.smoke
    name = "tiny" if smoke else "base"
    batch, seq = (2, 64) if smoke else (ctx.options["batch"], ctx.options["seq"])
    config = preset(name, kda_backend="auto")
    if seq > config.max_seq_len:
        config = config.replace(max_seq_len=seq)
    params = count_parameters(config)
    out.update(preset=name, batch=batch, seq=seq, params=params.total, active=params.active,
               flops_per_token=flops_per_token(config, seq), peak_bf16_tflops=peak_tflops,
               kda_backend="fla" if device.type == "cuda" and fla_available() else "torch",
               checkpointing=ctx.options["checkpointing"],
               optimizer="MuonAdamW, ns_dtype auto (bf16 on CUDA)")
    variants = ["compiled", "eager"]
    if device.type != "cuda" or not ctx.options["compile"]:
        variants = ["eager"]
        out["compiled"] = {"skipped": "compile runs on CUDA only here (CPU compile takes "
                           "minutes); the compiled-vs-eager check is tests/ and bench_trainer"
                           if device.type != "cuda" else "--no-compile"}
    ctx.log(f"train: {name} preset, {params.total / 1e6:,.1f} M params "
            f"({params.active / 1e6:,.1f} M active), {batch}x{seq}, KDA {out['kda_backend']}")
    for variant in variants:
        if not ctx.has(90 if variant == "compiled" else 45) and not smoke:
            out[variant] = {"skipped": "time limit"}
            ctx.log(f"train {variant}: skipped (time limit)")
            continue
        ctx.log(f"train {variant}: starting")
        try:
            out[variant] = _train_variant(ctx, config, batch, seq, variant == "compiled",
                                          peak_tflops)
        except torch.cuda.OutOfMemoryError:
            out[variant] = {"error": "CUDA out of memory: try --checkpointing block or a "
                            "smaller --batch"}
            _free(device)
        except Exception:  # keep going: eager still tells something when compile fails
            out[variant] = {"error": traceback.format_exc(limit=4)}
            traceback.print_exc()
            _free(device)
        ctx.save()
        r = out[variant]
        if "step_ms" in r:
            mfu = "unknown device" if r["mfu"] is None else f"{r['mfu']:.1%}"
            memory = "" if r["peak_memory_gib"] is None else f", {r['peak_memory_gib']:.1f} GiB"
            ctx.log(f"train {variant}: {r['step_ms']:.1f} ms/step (optimizer "
                    f"{r['optimizer_ms']:.1f}), {r['tokens_per_s']:,.0f} tok/s, MFU {mfu}"
                    f"{memory}, warm-up {r['warmup_s']:.1f} s, loss {r['loss_first']:.3f} -> "
                    f"{r['loss_last']:.3f}")
    if "step_ms" in out.get("compiled", {}) and "step_ms" in out.get("eager", {}):
        out["compiled_speedup"] = out["eager"]["step_ms"] / out["compiled"]["step_ms"]
        ctx.save()


def _ep_worker(rank: int, world: int, port: int, data: str, settings: dict[str, Any],
               out: str) -> None:
    """One rank (one GPU, or a gloo CPU process in the smoke run): FSDP2, then FSDP2 with
    the experts split over every rank, through bench_distributed's trainer loop."""
    import json
    import os
    from pathlib import Path

    from bench_distributed import _step_seconds
    from k3_trainer.distributed import init_parallel, shutdown

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda" if settings["cuda"] else "cpu")
    parallel = None
    results: dict[str, Any] = {}
    for degree in (1, world):
        parallel, _ = init_parallel("fsdp", device)
        assert parallel is not None
        traffic: dict[str, float] = {}
        seconds = _step_seconds(Path(data), settings, parallel, degree, traffic)
        results[f"ep{degree}"] = {"step_s": sorted(seconds)[len(seconds) // 2],
                                  "expert_bytes_per_step": traffic["bytes"]}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown(parallel)


def expert_parallel(ctx: Context, out: dict[str, Any]) -> None:
    """FSDP2 vs FSDP2 + expert parallelism over every GPU of this machine (NCCL), equal
    global batch: median step time and the expert bytes per rank and step (FSDP2: the
    expert stacks' all-gathers and reduce-scatter, from their size; EP: the counted token
    all-to-alls). Smoke: 2 gloo CPU ranks, a shrunk model."""
    import json
    import socket
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    from k3_trainer import prepare_dataset

    cuda = ctx.device.type == "cuda"
    world = torch.cuda.device_count() if cuda else 2
    if cuda and world < 2:
        out["skipped"] = "needs 2 or more GPUs (one rank per GPU)"
        ctx.log(f"expert_parallel: skipped: {out['skipped']}")
        return
    if ctx.smoke:
        settings: dict[str, Any] = {
            "model": dict(d_model=32, n_layers=2, n_heads=2, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_experts=4,
                          moe_d_ff=32, d_ff=64),
            "batch": 4, "seq_len": 32, "warmup": 1, "steps": 2}
    else:  # the small preset with as many experts as 4 per GPU, bf16 autocast
        settings = {"preset": "small", "model": dict(n_experts=4 * world), "batch": 8 * world,
                    "seq_len": 1024, "warmup": 2, "steps": 5, "precision": "bf16"}
    settings["cuda"] = cuda
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
        probe.close()
        data = Path(tmp) / "builtin"
        prepare_dataset([], data)
        result = Path(tmp) / "ep.json"
        mp.spawn(_ep_worker, args=(world, port, str(data), settings, str(result)),
                 nprocs=world)
        measured = json.loads(result.read_text())
    out.update(world=world, settings={k: v for k, v in settings.items() if k != "cuda"},
               **measured)
    fsdp, ep = measured["ep1"], measured[f"ep{world}"]
    out["step_ratio_ep_to_fsdp"] = ep["step_s"] / fsdp["step_s"]
    out["bytes_ratio_ep_to_fsdp"] = ep["expert_bytes_per_step"] / fsdp["expert_bytes_per_step"]
    ctx.log(f"expert_parallel: {world} ranks, step EP/FSDP {out['step_ratio_ep_to_fsdp']:.3f}, "
            f"expert bytes EP/FSDP {out['bytes_ratio_ep_to_fsdp']:.3f}")


def documents(ctx: Context, out: dict[str, Any]) -> None:
    """Documents kept apart on the device (fla's varlen kernel, ``cu_seqlens``, when
    installed): a ``document_ids`` forward against each document alone (fp32), and the
    training step's time with and without the ids (bf16 autocast)."""
    from k3_model import K3Model, preset

    device = ctx.device
    _, fla_note = _fla() if device.type == "cuda" else (None, "CUDA only")
    out["fla"] = fla_note
    seq = 64 if ctx.smoke else 2048
    torch.manual_seed(0)
    model = K3Model(preset("tiny", max_seq_len=seq)).to(device).eval()
    lengths = [7, 1, 40, 16] if ctx.smoke else [300, 1, 777, 64, 906]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    ids = ids.to(device)
    x = torch.randint(0, model.config.vocab_size, (1, seq), device=device)
    with torch.no_grad():
        masked = model(x, document_ids=ids)[0]
        alone = torch.cat([model(x[:, ids[0] == d])[0] for d in range(len(lengths))], dim=1)
    out["agreement_fp32_max_rel"] = float((masked - alone).abs().max() / alone.abs().max())
    ctx.log(f"documents: masked vs alone, fp32: max rel {out['agreement_fp32_max_rel']:.2e}")
    model.train()
    batch = 2 if ctx.smoke else 8
    xb = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    idb = ids.expand(batch, seq)

    def step(with_ids: bool) -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(xb, xb, document_ids=idb if with_ids else None)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)

    for name, with_ids in (("plain_s", False), ("masked_s", True)):
        out[name] = ctx.time(lambda w=with_ids: step(w), repeats=2 if ctx.smoke else 10)
    out["masked_over_plain"] = out["masked_s"] / out["plain_s"]
    ctx.log(f"documents: step {batch}×{seq} plain {out['plain_s'] * 1e3:.1f} ms, masked "
            f"{out['masked_s'] * 1e3:.1f} ms ({out['masked_over_plain']:.2f}×)")


def decode(ctx: Context, out: dict[str, Any]) -> None:
    """Generation with the cache on the GPU: cached logits against the full forward (fp32),
    then the per-step time of a decoding step (bf16 weights, fla's fused recurrent kernel
    when installed) eager, replayed from a CUDA graph (a static cache: fixed buffers, write
    position on the device), and recomputing the whole context, at contexts 1024 and
    4096, batch 1 and 8. Eager steps run under ``torch.cuda.set_sync_debug_mode("error")``:
    a step that waited for the device would fail there."""
    from k3_model import K3Model, preset

    device, smoke = ctx.device, ctx.smoke
    cuda = device.type == "cuda"
    _, fla_note = _fla() if cuda else (None, "CUDA only")
    out["fla"] = fla_note
    name = "tiny" if smoke else "small"
    contexts, batches, steps = ([64], [1], 4) if smoke else ([1024, 4096], [1, 8], 32)
    torch.manual_seed(0)
    model = K3Model(preset(name, max_seq_len=max(contexts) + 4 * steps + 8)).to(device).eval()
    x = torch.randint(0, model.config.vocab_size, (2, 200 if not smoke else 40),
                      device=device)
    with torch.no_grad():
        full = model(x)[0]
        cache = model.new_cache(x.shape[1])
        cut = x.shape[1] - 8
        parts = [model.forward_cached(x[:, :cut], cache)]
        parts += [model.forward_cached(x[:, i:i + 1], cache) for i in range(cut, x.shape[1])]
    got = torch.cat(parts, dim=1)
    out["agreement_fp32_max_rel"] = float((got - full).abs().max() / full.abs().max())
    ctx.log(f"decode: cached vs full forward, fp32 {name}: max rel "
            f"{out['agreement_fp32_max_rel']:.2e}")
    model = model.to(torch.bfloat16)
    rows: dict[str, Any] = {}
    out["preset"], out["rows"] = name, rows
    for context in contexts:
        for batch in batches:
            if not ctx.has(30):
                rows[f"context={context} batch={batch}"] = {"skipped": "time limit"}
                continue
            row = _decode_row(ctx, model, context, batch, steps, cuda)
            rows[f"context={context} batch={batch}"] = row
            ctx.save()
            ctx.log(f"decode context {context} batch {batch}: " + ", ".join(
                f"{k} {v:,.3f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in row.items()))


@torch.no_grad()
def _decode_row(ctx: Context, model: Any, context: int, batch: int, steps: int,
                cuda: bool) -> dict[str, Any]:
    """Milliseconds per decoding step: eager, graphed (where capture works), recomputing."""
    device = ctx.device
    total = context + 4 * steps + 4
    ids = torch.randint(0, model.config.vocab_size, (batch, total), device=device)
    row: dict[str, Any] = {}
    eager = model.new_cache(total)
    model.forward_cached(ids[:, :context], eager)
    at = [context]

    def eager_steps() -> None:
        for _ in range(steps):
            model.forward_cached(ids[:, at[0]:at[0] + 1], eager)[:, -1].argmax(-1)
            at[0] += 1

    eager_steps()  # warm-up (kernels compiled, caches allocated)
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        row["eager_ms"] = ctx.time(eager_steps, 1, warmup=0) / steps * 1e3
        row["host_syncs_per_step"] = 0 if cuda else "not checked (CPU)"
    except RuntimeError as exc:  # a synchronizing call inside a step
        row["host_syncs_per_step"] = f"≥ 1: {str(exc).splitlines()[0][:120]}"
        row["eager_ms"] = ctx.time(eager_steps, 1, warmup=0) / steps * 1e3
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    if cuda:
        row.update(_graphed(ctx, model, ids, context, steps))
        if "graphed_ms" in row:
            row["graphed_speedup"] = row["eager_ms"] / row["graphed_ms"]

    def recompute() -> None:
        model(ids[:, :context + 1])[0][:, -1].argmax(-1)

    row["recompute_ms"] = ctx.time(recompute, 2) * 1e3
    row["eager_vs_recompute"] = row["recompute_ms"] / row["eager_ms"]
    return row


def _graphed(ctx: Context, model: Any, ids: torch.Tensor, context: int, steps: int
             ) -> dict[str, Any]:
    """One decoding step captured in a CUDA graph on a static cache, then replayed: the
    token buffer is refilled from the step's own greedy pick inside the graph."""
    try:
        cache = model.new_cache(ids.shape[1], static=True)
        model.forward_cached(ids[:, :context], cache)
        token = ids[:, context:context + 1].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up steps outside the graph, as CUDA asks
            for _ in range(2):
                token.copy_(model.forward_cached(token, cache)[:, -1:].argmax(-1))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            token.copy_(model.forward_cached(token, cache)[:, -1:].argmax(-1))
    except Exception as exc:  # a capture failure is a result to report
        return {"graphed": f"capture failed: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:160]}"}

    def replay() -> None:
        for _ in range(steps):
            graph.replay()

    return {"graphed_ms": ctx.time(replay, 1, warmup=0) / steps * 1e3}


def checkpoint(ctx: Context, out: dict[str, Any]) -> None:
    """The training stall per checkpoint on this device, synchronous against background
    saves (bench:trainer's table: the snapshot copies to pinned host memory here); the
    small preset in bf16 autocast (smoke: tiny on CPU)."""
    import tempfile
    from pathlib import Path

    from bench_trainer import QUICK_SHAPE, bench_checkpoint_stall
    from k3_trainer import prepare_dataset

    data = Path(tempfile.mkdtemp()) / "builtin"
    prepare_dataset([], data)
    presets = ["tiny"] if ctx.smoke else ["tiny", "small"]
    results = bench_checkpoint_stall(presets, data, device=ctx.device, **(
        {"repeats": 1, "checkpoints": 2, "interval": 4, "window": 2, "shape": QUICK_SHAPE}
        if ctx.smoke else {"repeats": 2, "checkpoints": 3}))
    for name, row in results.items():
        out[name] = {key: row[key] for key in ("step_s", "stall_s", "blocked_s", "write_s",
                                               "held_bytes", "ratio")}
        ctx.log(f"checkpoint {name}: stall sync {row['stall_s']['sync'] * 1e3:.1f} ms, async "
                f"{row['stall_s']['async'] * 1e3:.1f} ms ({row['ratio']:.3f}x), blocked "
                f"{row['blocked_s']['async'] * 1e3:.1f} ms, holds "
                f"{row['held_bytes'] / 2**20:.0f} MiB")
    ctx.save()
