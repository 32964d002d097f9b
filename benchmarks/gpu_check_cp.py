"""The ``cp`` section of ``gpu_check.py``: KDA's context-parallel state passing on the device.

Written without a GPU to run it on (k3-model's CPU tests prove the same path on gloo);
every part records what it did or why it did not.

1. **Exactness on one GPU.** The sequence is cut into N slices that run one after another
   through the ranks' own code (``k3_model.state_passing``: ``slice_summary``,
   ``carry_in``, ``settle``), against ``chunk_kda`` over the whole sequence; fp32 inputs,
   outputs and every input gradient (max relative error), N = 2, 4, 8. With
   flash-linear-attention installed, the slices are also compared with fla's kernel over
   the whole sequence (bf16 inputs, its own tolerance).
2. **Memory and time on one GPU.** Peak CUDA memory and time of one slice's forward +
   backward (what a rank of N holds) against the whole sequence, bf16 inputs as the KDA
   layer passes them.
3. **The model over NCCL** (2 or more GPUs, one rank each; skipped with one): the
   ``small`` preset under ``K3Model.set_context_parallel`` against one process, fp32, with
   documents crossing the slices: loss and gradients; and, where ``fla.ops.cp`` imports,
   fla's context-parallel ``chunk_kda`` on the same slices against ours.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.nn.functional as F

from gpu_check_k3 import Context


def _inputs(t: int, h: int, d: int, device: torch.device, dtype: torch.dtype
            ) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, k = (F.normalize(randn(1, t, h, d), dim=-1).to(dtype) for _ in range(2))
    v = randn(1, t, h, d).to(dtype)
    g = -5.0 * torch.sigmoid(2.0 * randn(1, t, h, d))
    beta = torch.sigmoid(randn(1, t, h))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _run(fn: Any, inputs: list[torch.Tensor], grad: torch.Tensor
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for x in inputs:
        x.grad = None
    o = fn(*inputs)
    o.backward(grad)
    return o.detach().float(), [x.grad.detach().float() for x in inputs]  # type: ignore[union-attr]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def context_parallel(ctx: Context, out: dict[str, Any]) -> None:
    from k3_model.kda import chunk_kda
    from k3_model.state_passing import kda_over_slices, settle, slice_summary

    device, smoke = ctx.device, ctx.smoke
    t, h, d, chunk = (256, 2, 16, 64) if smoke else (16384, 16, 128, 64)
    scale = d**-0.5
    out.update(shape=f"B=1 T={t} H={h} K=V={d}", chunk=chunk)

    def whole(*x: torch.Tensor) -> torch.Tensor:
        return chunk_kda(*x, scale=scale, chunk_size=chunk, gate_lower_bound=-5.0)[0]

    # 1. Exactness, fp32.
    inputs = _inputs(t, h, d, device, torch.float32)
    grad = torch.randn(1, t, h, d, device=device, generator=torch.Generator(
        device=device).manual_seed(1))
    ref_o, ref_grads = _run(whole, inputs, grad)
    agreement: dict[str, Any] = {}
    for n in (2, 4, 8):
        o, grads = _run(lambda *x, n=n: kda_over_slices(*x, n, scale=scale, chunk_size=chunk,
                                                        gate_lower_bound=-5.0), inputs, grad)
        agreement[f"{n} slices"] = {"o": _rel(o, ref_o),
                                    "grads": max(_rel(a, b) for a, b in zip(grads, ref_grads))}
        ctx.log(f"cp: {n} slices vs whole (fp32): o rel {agreement[f'{n} slices']['o']:.1e}, "
                f"worst grad rel {agreement[f'{n} slices']['grads']:.1e}")
    out["agreement_fp32"] = agreement
    ctx.save()
    _against_fla(ctx, out, t, h, d, scale, chunk)

    # 2. One slice's memory and time against the whole sequence, bf16 inputs.
    inputs = _inputs(t, h, d, device, torch.bfloat16)
    grad = torch.randn(1, t, h, d, device=device, dtype=torch.bfloat16)
    rows: dict[str, Any] = {}
    for n in (1, 2, 4, 8):
        part = [x.detach()[:, : t // n].clone().requires_grad_() for x in inputs]
        incoming = torch.zeros(1, h, d, d, device=device)

        def one_slice(*x: torch.Tensor, incoming: torch.Tensor = incoming) -> torch.Tensor:
            o0, reads, _ = slice_summary(*x, scale=scale, chunk_size=chunk,
                                         gate_lower_bound=-5.0)
            return settle(o0, reads, incoming, x[2].dtype)

        fn = whole if n == 1 else one_slice
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        seconds = ctx.time(lambda fn=fn, part=part, n=n: _run(fn, part, grad[:, : t // n]),
                           repeats=1 if smoke else 5)
        peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
        rows["whole" if n == 1 else f"1 of {n} slices"] = {"ms": seconds * 1e3,
                                                           "peak_bytes": peak}
        ctx.log(f"cp: {'whole' if n == 1 else f'1 of {n} slices'}: {seconds * 1e3:.1f} ms"
                + ("" if peak is None else f", peak {peak / 2**20:.0f} MiB"))
        ctx.save()
    out["slice_cost_bf16"] = rows
    _model_over_nccl(ctx, out)


def _against_fla(ctx: Context, out: dict[str, Any], t: int, h: int, d: int, scale: float,
                 chunk: int) -> None:
    """Our slices (bf16 inputs) against fla's kernel over the whole sequence."""
    if ctx.device.type != "cuda":
        out["fla"] = "CUDA only"
        return
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as error:  # ImportError, or a triton/driver error at import
        out["fla"] = f"not importable ({type(error).__name__}); pip install flash-linear-attention"
        return
    from k3_model.state_passing import kda_over_slices

    inputs = _inputs(t, h, d, ctx.device, torch.bfloat16)
    grad = torch.randn(1, t, h, d, device=ctx.device, dtype=torch.bfloat16)
    ref_o, ref_grads = _run(lambda *x: fla_chunk_kda(*x, scale=scale,
                                                     use_qk_l2norm_in_kernel=False)[0],
                            inputs, grad)
    o, grads = _run(lambda *x: kda_over_slices(*x, 4, scale=scale, chunk_size=chunk,
                                               gate_lower_bound=-5.0), inputs, grad)
    out["fla"] = {"4 slices vs fla whole, bf16: o rel": _rel(o, ref_o),
                  "worst grad rel": max(_rel(a, b) for a, b in zip(grads, ref_grads))}
    ctx.log(f"cp: 4 slices (ours) vs fla over the whole sequence, bf16: {out['fla']}")


def _nccl_worker(rank: int, world: int, port: int, out_path: str) -> None:
    """One rank per GPU: the small preset under context parallelism against the whole
    sequence in this process; fla's CP kernel where it imports."""
    import datetime
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    from k3_model import K3Model, preset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=5))
    device = torch.device("cuda", rank)
    seq = 512 * world
    result: dict[str, Any] = {}
    try:
        gen = torch.Generator().manual_seed(3)
        x = torch.randint(0, 32768, (2, seq + 1), generator=gen).to(device)
        ids = (torch.arange(seq) // 700).expand(2, seq).contiguous().to(device)
        grads = []
        for cp in (False, True):
            torch.manual_seed(0)
            model = K3Model(preset("small", max_seq_len=seq, kda_backend="torch")).to(device)
            n = seq // world if cp else seq
            lo = rank * n if cp else 0
            if cp:
                model.set_context_parallel(dist.group.WORLD)
            _, loss = model(x[:, lo:lo + n], x[:, lo + 1:lo + n + 1],
                            document_ids=ids[:, lo:lo + n])
            loss.backward()
            flat = torch.cat([p.grad.flatten() for p in model.parameters()
                              if p.grad is not None])
            if cp:
                dist.all_reduce(loss)
                dist.all_reduce(flat)
                loss, flat = loss / world, flat / world
            grads.append((loss.detach(), flat))
        (loss1, g1), (loss_cp, g_cp) = grads
        result["model_loss_rel"] = float((loss_cp - loss1).abs() / loss1.abs())
        result["model_grad_rel"] = float((g_cp - g1).abs().max() / g1.abs().max())
        result["fla_cp"] = _fla_cp(rank, world, device)
    except Exception:
        result["error"] = traceback.format_exc(limit=3)
    if rank == 0:
        Path(out_path).write_text(json.dumps(result, default=str))
    dist.destroy_process_group()


def _fla_cp(rank: int, world: int, device: torch.device) -> Any:
    """fla's context-parallel chunk_kda on this rank's slice against ours (the same
    slices through k3_model.state_passing, gathered), bf16 inputs."""
    try:
        from fla.ops.cp import build_cp_context  # type: ignore[attr-defined]
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except Exception as error:
        return f"fla.ops.cp not importable ({type(error).__name__})"
    import torch.distributed as dist

    from k3_model.state_passing import kda_over_slices

    t, h, d = 1024 * world, 16, 128
    full = [x.detach() for x in _inputs(t, h, d, device, torch.bfloat16)]
    ours = kda_over_slices(*full, world, scale=d**-0.5, chunk_size=64, gate_lower_bound=-5.0)
    n = t // world
    context = build_cp_context(torch.tensor([0, t], device=device), group=dist.group.WORLD,
                               conv1d_kernel_size=4)
    theirs, _ = fla_chunk_kda(*(x[:, rank * n:(rank + 1) * n] for x in full),
                              scale=d**-0.5, use_qk_l2norm_in_kernel=False,
                              cp_context=context)
    mine = ours[:, rank * n:(rank + 1) * n].float()
    rel = torch.tensor(_rel(theirs.float(), mine), device=device)
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    return {"o rel, fla CP vs ours (bf16)": float(rel)}


def _model_over_nccl(ctx: Context, out: dict[str, Any]) -> None:
    import json
    import socket
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    if world < 2:
        out["model_nccl"] = {"skipped": "needs 2 or more GPUs (one rank per GPU); the CPU "
                                        "tests run the model under CP on gloo"}
        ctx.log(f"cp: model over NCCL skipped: {out['model_nccl']['skipped']}")
        return
    world = min(world, 4)
    if not ctx.has(120):
        out["model_nccl"] = {"skipped": "time limit"}
        return
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
        probe.close()
        path = Path(tmp) / "cp.json"
        mp.spawn(_nccl_worker, args=(world, port, str(path)), nprocs=world)
        out["model_nccl"] = {"world": world, **json.loads(path.read_text())}
    ctx.log(f"cp: model over NCCL: {out['model_nccl']}")
