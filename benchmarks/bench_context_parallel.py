"""Context parallelism: saved activations per rank and step time at CP 1, 2 and 4.

Run: ``hatch run bench:context-parallel`` (``--quick`` for the smoke run). One fixed long
sequence (the ``small`` preset, one row of ``--seq`` tokens, the loss in chunks of 2048
so no full logits tensor exists, bf16 autocast as a GPU would train) is split over 1, 2
and 4 gloo ranks on CPU, each rank one thread; every degree runs in fresh processes,
one after another in one run.

Measured per rank (the table reports the largest rank, the last one, which holds the
most gathered keys):

- **saved activations**: the bytes of every tensor autograd saves for the backward in
  one forward (``torch.autograd.graph.saved_tensors_hooks``), each storage once,
  parameters left out, split by where it was saved (KDA, MLA and MoE layers, the rest:
  embedding, norms, residual reads, loss). Boolean masks are counted apart: on CPU the
  lower-right causal mask and the document masks are materialized; fused GPU kernels
  take the causal one without it.
- **step time**: forward + backward, the median of ``--steps`` after one warm-up; and
  the summed CPU time of all ranks, whose ratio to CP 1 is the work context parallelism
  adds (on a 2-core machine CP 4's four ranks share the cores, so its wall time mostly
  shows that).

Then **the longest sequence per 24 GiB**: per degree, saved bytes per rank are fitted as
``a + b·T`` over two lengths (``--fit-seqs``), and ``T_max = (24 GiB − state − a) / b``,
with ``state`` the replicated fp32 weights, gradients and MuonAdamW state (4 + 4 + 4 B
per Muon parameter, 4 + 4 + 8 B per AdamW one); transient workspace is not counted.

And the two choices of the KDA state passing, measured on one slice of ``small``'s KDA
shape: **one augmented pass** (``chunk_kda`` on ``[v | 0]`` from ``[0 | I]``, outputs
settled with ``P·S_in``, what k3-model does) against **two passes** (the summary, then
``chunk_kda`` again from the incoming state), forward + backward time and saved bytes;
and **all-gather** of every rank's ``[S₀ | M]`` against passing the state **rank to
rank** (N − 1 sequential hops), forward exchange time on the CP 4 group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import interleaved, print_table, write_json
from k3_model import K3Model, chunk_kda, preset
from k3_model.kda import l2_normalize
from k3_model.state_passing import settle, slice_summary

GIB = 2**30
BUDGET = 24 * GIB
DEGREES = (1, 2, 4)


def _settings(quick: bool, seq: int, fit: list[int], steps: int) -> dict[str, Any]:
    if quick:
        return {"preset": "tiny", "seq": 128, "fit": [64, 128], "steps": 1, "slice": 64}
    return {"preset": "small", "seq": seq, "fit": fit, "steps": steps, "slice": 1024}


class SavedBytes:
    """Bytes autograd saves in the forwards run inside :meth:`measure`, per label."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.label = "other"
        self.seen: dict[int, tuple[str, int]] = {}
        for name, module in model.named_modules():
            parts = name.split(".")
            if len(parts) == 3 and parts[0] == "layers" and parts[2] in ("attn", "mlp"):
                kind = (module.__class__.__name__.replace("KimiDeltaAttention", "KDA")
                        .replace("MLAttention", "MLA").replace("GatedMLP", "dense MLP")
                        .replace("MoE", "MoE").replace("GQAttention", "GQA"))
                module.register_forward_pre_hook(lambda m, a, kind=kind: self._set(kind))
                module.register_forward_hook(lambda m, a, o: self._set("other"))

    def _set(self, label: str) -> None:
        self.label = label

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            label = "masks (bool)" if tensor.dtype == torch.bool else self.label
            self.seen[ptr] = (label, storage.nbytes())
        return tensor

    def measure(self, fn: Callable[[], torch.Tensor]) -> dict[str, int]:
        """Run ``fn`` (a forward returning a loss) under the hooks, then its backward."""
        self.seen = {}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            loss = fn()
        loss.backward()
        totals: dict[str, int] = {}
        for label, nbytes in self.seen.values():
            totals[label] = totals.get(label, 0) + nbytes
        return totals


def _model(settings: dict[str, Any], seq: int) -> K3Model:
    torch.manual_seed(0)
    return K3Model(preset(settings["preset"], max_seq_len=seq, loss_chunk_size=2048))


def _forward(model: K3Model, tokens: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = (tokens.shape[1] - 1) // world
    rows = tokens[:, rank * n:(rank + 1) * n + 1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(rows[:, :-1], rows[:, 1:])
    return loss / world


def _exchanges(world: int, summary: torch.Tensor, repeats: int = 20) -> dict[str, float]:
    """Median seconds of one forward exchange of the KDA summaries: the all-gather the
    model uses, and the rank-to-rank chain (rank r waits for r − 1's state, then sends
    its own outgoing state on)."""
    from k3_model.context_parallel import ContextParallel

    cp = ContextParallel(dist.group.WORLD)
    rank = dist.get_rank()
    state = summary[..., : summary.shape[-1] // 2].contiguous()
    gather, chain = [], []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        cp.gather(summary)
        dist.barrier()
        gather.append(time.perf_counter() - start)
        start = time.perf_counter()
        incoming = torch.empty_like(state)
        if rank > 0:
            dist.recv(incoming, rank - 1)
        if rank < world - 1:
            dist.send(state + incoming, rank + 1)
        dist.barrier()
        chain.append(time.perf_counter() - start)
    return {"all_gather_s": statistics.median(gather), "chain_s": statistics.median(chain)}


def _worker(rank: int, world: int, init: str, settings: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(minutes=30))
    results: dict[str, Any] = {"saved": {}}
    for seq in sorted({*settings["fit"], settings["seq"]}):
        model = _model(settings, seq)
        if world > 1:
            model.set_context_parallel(dist.group.WORLD)
        tokens = torch.randint(0, model.config.vocab_size, (1, seq + 1),
                               generator=torch.Generator().manual_seed(1))
        saved = SavedBytes(model).measure(
            lambda model=model, tokens=tokens: _forward(model, tokens, rank, world))
        results["saved"][seq] = saved
        if seq != settings["seq"]:
            continue
        walls, cpus = [], []
        for step in range(1 + settings["steps"]):
            if world > 1:
                dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            _forward(model, tokens, rank, world).backward()
            if world > 1:
                dist.barrier()
            if step:
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
        results.update(step_s=statistics.median(walls), cpu_s=statistics.median(cpus))
        kda = next((layer.attn for layer in model.layers if layer.kind == "kda"), None)
        if world == 4 and kda is not None:
            h, e = kda.n_heads, kda.head_dim
            results["exchange"] = _exchanges(world, torch.randn(1, h, e, 2 * e))
        results["state_bytes"] = _state_bytes(model)
    Path(out).write_text(json.dumps(results))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _state_bytes(model: K3Model) -> int:
    """fp32 weights and gradients, plus MuonAdamW's state: 4 B per Muon parameter (one
    momentum), 8 B per AdamW one (two moments); replicated on every rank."""
    total = 0
    for group in model.parameter_groups():
        optimizer = 4 if group["use_muon"] else 8
        total += sum(p.numel() for p in group["params"]) * (8 + optimizer)
    return total


def _kda_passes(settings: dict[str, Any], repeats: int) -> dict[str, Any]:
    """One augmented pass against two passes on one slice of the preset's KDA shape."""
    torch.set_num_threads(1)
    config = preset(settings["preset"])
    h, e, t = config.kda_n_heads, config.kda_dim, settings["slice"]
    gen = torch.Generator().manual_seed(0)
    q, k = (l2_normalize(torch.randn(1, t, h, e, generator=gen)) for _ in range(2))
    v = torch.randn(1, t, h, e, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(1, t, h, e, generator=gen))
    beta = torch.sigmoid(torch.randn(1, t, h, generator=gen))
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    incoming = torch.randn(1, h, e, e, generator=gen)
    # The gradient the later ranks send back for this slice's [S0 | M].
    later = torch.randn(1, h, e, 2 * e, generator=gen)
    chunk = config.kda_chunk_size

    def one_pass() -> torch.Tensor:
        o0, reads, summary = slice_summary(*inputs, scale=e**-0.5, chunk_size=chunk,
                                           gate_lower_bound=-5.0)
        o = settle(o0, reads, incoming, v.dtype)
        return o.square().sum() + (summary * later).sum()

    def two_passes() -> torch.Tensor:
        _, _, summary = slice_summary(*inputs, scale=e**-0.5, chunk_size=chunk,
                                      gate_lower_bound=-5.0)
        o, _ = chunk_kda(*inputs, scale=e**-0.5, chunk_size=chunk, gate_lower_bound=-5.0,
                         initial_state=incoming)
        return o.square().sum() + (summary * later).sum()

    result: dict[str, Any] = {"shape": f"1 × {t} tokens × {h} heads × {e}"}
    for name, fn in (("one pass", one_pass), ("two passes", two_passes)):
        params = torch.nn.Module()
        result[name] = {"saved_bytes": sum(SavedBytes(params).measure(fn).values())}
    timings = interleaved({name: (lambda fn=fn: fn().backward())
                           for name, fn in (("one pass", one_pass), ("two passes", two_passes))},
                          repeats=repeats)
    for name, timing in timings.items():
        result[name]["step_s"] = timing.median
    return result


def _fit(saved: dict[str, dict[str, int]]) -> tuple[float, float]:
    """``(a, b)`` of ``bytes = a + b·T`` through the two shortest measured lengths (masks
    left out: materialized on CPU only)."""
    points = sorted((int(seq), sum(v for k, v in parts.items() if k != "masks (bool)"))
                    for seq, parts in saved.items())[:2]
    (t0, y0), (t1, y1) = points
    slope = (y1 - y0) / (t1 - t0)
    return y0 - slope * t0, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny preset, short sequence")
    parser.add_argument("--seq", type=int, default=4096, help="the long sequence (4096)")
    parser.add_argument("--fit-seqs", type=int, nargs=2, default=[1024, 2048],
                        help="two lengths for the memory fit (1024 2048)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per degree (2)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    settings = _settings(args.quick, args.seq, args.fit_seqs, args.steps)
    runs: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in DEGREES:
            outs = [f"{tmp}/cp{world}.rank{r}.json" for r in range(world)]
            # Forked, not spawned: each rank starts with torch and k3 imported (the parent
            # has run no torch computation yet, so no OpenMP pool is copied half-alive).
            mp.start_processes(_spawned, args=(world, f"{tmp}/init{world}", settings, outs),
                               nprocs=world, start_method="fork")
            runs[world] = [json.loads(Path(o).read_text()) for o in outs]
    passes = _kda_passes(settings, repeats=2 if args.quick else 5)
    _report(settings, runs, passes, args.json)


def _spawned(rank: int, world: int, init: str, settings: dict[str, Any],
             outs: list[str]) -> None:
    _worker(rank, world, init, settings, outs[rank])


def _report(settings: dict[str, Any], runs: dict[int, list[dict[str, Any]]],
            passes: dict[str, Any], json_path: str | None) -> None:
    seq, load = settings["seq"], os.getloadavg()
    base = runs[1][0]
    labels = sorted({label for rank in (r[-1] for r in runs.values())
                     for label in rank["saved"][str(seq)]})
    rows, fits = [], {}
    for world, ranks in runs.items():
        last = ranks[-1]
        saved = last["saved"][str(seq)]
        total = sum(v for k, v in saved.items() if k != "masks (bool)")
        base_total = sum(v for k, v in base["saved"][str(seq)].items() if k != "masks (bool)")
        cpu = sum(r["cpu_s"] for r in ranks)
        a, b = _fit(last["saved"])
        t_max = (BUDGET - last["state_bytes"] - a) / b
        fits[world] = {"intercept_bytes": a, "bytes_per_token": b, "longest_seq": t_max}
        rows.append([f"CP {world}", f"{total / GIB:.3f}", f"{total / base_total:.3f}",
                     *(f"{saved.get(label, 0) / GIB:.3f}" for label in labels),
                     f"{last['step_s']:.2f}", f"{last['step_s'] / base['step_s']:.2f}",
                     f"{cpu / base['cpu_s']:.2f}", f"{b / 2**10:.1f}",
                     f"{t_max / 1e3:,.0f} K"])
    print_table(f"Context parallelism, {settings['preset']} preset, one row of {seq} tokens, "
                f"bf16 autocast, CPU/gloo, 1 thread per rank (load {load[0]:.2f})",
                ["degree", "saved GiB / rank", "× CP 1",
                 *(f"{label} GiB" for label in labels), "step s", "step × CP 1",
                 "CPU time × CP 1", "KiB / token (fit)", "longest T per 24 GiB"], rows)
    exchange = runs[4][0].get("exchange")
    if exchange:
        print_table("KDA summaries exchanged over 4 ranks (forward, one layer)",
                    ["all-gather ms", "rank-to-rank chain ms", "chain ÷ all-gather"],
                    [[f"{exchange['all_gather_s'] * 1e3:.3f}",
                      f"{exchange['chain_s'] * 1e3:.3f}",
                      f"{exchange['chain_s'] / exchange['all_gather_s']:.2f}"]])
    one, two = passes["one pass"], passes["two passes"]
    print_table(f"KDA on one slice ({passes['shape']}), fp32, forward + backward",
                ["form", "saved MiB", "ms", "× one pass"],
                [[name, f"{r['saved_bytes'] / 2**20:.1f}", f"{r['step_s'] * 1e3:.1f}",
                  f"{r['step_s'] / one['step_s']:.2f}"]
                 for name, r in (("one pass", one), ("two passes", two))])
    write_json(json_path, {"settings": settings, "runs": {str(k): v for k, v in runs.items()},
                           "fits": fits, "kda_passes": passes, "loadavg": load})


if __name__ == "__main__":
    main()
