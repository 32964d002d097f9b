"""k3-model benchmarks, one named section each (``--only NAME``; default: every section).

  kda   ``chunk_kda`` vs ``recurrent_kda`` on CPU in fp32 at T = 256 / 1024 / 4096, B = 1,
        H = 4, K = V = 64 (one sequence of four K3-width heads: the shape of a small
        preset's KDA layer), forward under no_grad and forward+backward. Both run
        interleaved round by round; the table gives recurrent ÷ chunked (median of the
        per-round ratios, min–max). Goal: chunked ≥ 10× faster at T = 4096. Also chunked
        forward+backward per chunk size at the longest T.
  presets  tokens/s of a forward+backward of the hybrid ``tiny`` preset (3 KDA + 1 Gated
        MLA layers) vs the same preset with ``attention="mla"`` (4 MLA layers, equal
        width) at seq 1024 and 4096, batch 1, fp32. Goal: hybrid faster at 4096, where
        softmax attention's quadratic cost shows. Also the demo's step (batch 16 × seq
        128, forward+backward+MuonAdamW) of ``tiny`` vs the tiny preset before K3 (MLA +
        SwiGLU MoE), whose 300 steps fit the 2-minute demo budget.
  loss  the output head + cross-entropy, plain vs chunked
        (``chunked_cross_entropy``), vocab 32768, d 384, 1024 / 4096 tokens, fp32:
        bytes the forward keeps for the backward (profiler), peak RSS growth of one
        forward+backward (fresh process each) and the time ratio.
  ckpt  activation checkpointing "block" vs "none" on ``tiny`` and ``small`` at seq
        1024, batch 1, fp32 forward+backward: bytes kept by the forward, peak RSS
        growth, time ratio (the recomputation costs about one more forward).
  documents  the cost of keeping documents apart (``document_ids``): the demo step of
        ``tiny`` (batch 16 × seq 128, forward+backward+MuonAdamW, fp32) and a seq-1024
        batch-1 forward+backward, each row packing documents of 20–300 tokens (uniform,
        as prose paragraphs and short files), masked vs not; the time ratio.

Run: ``hatch run bench:model`` (``--quick``: short sequences, one round, the CI smoke run).

    python benchmarks/bench_model.py --only kda --json out.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common import interleaved, print_table, write_json
from k3_model import K3Config, K3Model, chunked_cross_entropy, preset
from k3_model.kda import chunk_kda, l2_normalize, recurrent_kda
from k3_optim import MuonAdamW

KDA_TARGET = 10.0  # issue 14: chunked ≥ 10× the recurrence at T = 4096 on CPU


def kda_inputs(t: int, b: int = 1, h: int = 4, d: int = 64) -> list[torch.Tensor]:
    """fp32 operator inputs as the K3 layer makes them: unit q/k, g ∈ (−5, 0), β ∈ (0, 1)."""
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(b, t, h, d, generator=gen))
    k = l2_normalize(torch.randn(b, t, h, d, generator=gen))
    v = torch.randn(b, t, h, d, generator=gen)
    g = -5.0 * torch.rand(b, t, h, d, generator=gen)
    beta = torch.rand(b, t, h, generator=gen)
    return [q, k, v, g, beta]


def kda_case(fn: Callable[..., tuple[torch.Tensor, object]], inputs: list[torch.Tensor],
             backward: bool, **kw: object) -> Callable[[], None]:
    leaves = [x.clone().requires_grad_(backward) for x in inputs]

    def run() -> None:
        if not backward:
            with torch.no_grad():
                fn(*leaves, **kw)
            return
        for x in leaves:
            x.grad = None
        o, _ = fn(*leaves, **kw)
        o.sum().backward()

    return run


def bench_kda(args: argparse.Namespace) -> dict[str, object]:
    lengths = [64, 128] if args.quick else [256, 1024, 4096]
    rounds = 1 if args.quick else args.rounds
    rows, results = [], {}
    for t in lengths:
        inputs = kda_inputs(t)
        for backward in (False, True):
            label = "forward+backward" if backward else "forward"
            timings = interleaved({"recurrent": kda_case(recurrent_kda, inputs, backward),
                                   "chunked": kda_case(chunk_kda, inputs, backward)},
                                  repeats=rounds, warmup=1)
            rec, chk = timings["recurrent"], timings["chunked"]
            ratios = [r / c for r, c in zip(rec.seconds, chk.seconds)]
            ratio = statistics.median(ratios)
            verdict = ("met" if ratio >= KDA_TARGET else "missed") if t == 4096 else ""
            rows.append([str(t), label, f"{rec.median * 1e3:.1f}", f"{chk.median * 1e3:.2f}",
                         f"{ratio:.1f}", f"{min(ratios):.1f}–{max(ratios):.1f}", verdict])
            results[f"T{t} {label}"] = {"recurrent_s": rec.seconds, "chunked_s": chk.seconds,
                                        "ratio": ratio}
    print_table(f"KDA operator, CPU fp32, B=1 H=4 K=V=64, {rounds} interleaved rounds",
                ["T", "pass", "recurrent ms", "chunked ms", "× faster", "min–max",
                 f"≥ {KDA_TARGET:.0f}× at 4096"], rows)

    t = lengths[-1]
    inputs = kda_inputs(t)
    sizes = {f"chunk {c}": kda_case(chunk_kda, inputs, True, chunk_size=c) for c in (16, 32, 64)}
    timings = interleaved(sizes, repeats=rounds, warmup=1)
    print_table(f"chunk_kda forward+backward per chunk size, T={t}",
                ["chunk size", "median ms", "min–max ms"],
                [[name, f"{tm.median * 1e3:.2f}", tm.spread()] for name, tm in timings.items()])
    results["chunk_sizes"] = {name: tm.seconds for name, tm in timings.items()}
    return results


# The tiny preset before Kimi K3 (all MLA with RoPE, SwiGLU MoE at full width, plain
# residual): the reference for the demo's time budget.
PRE_K3_TINY = K3Config(
    vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=256, attention="mla",
    kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    mlp="moe", d_ff=384, n_dense_layers=1, n_experts=8, moe_top_k=2, n_shared_experts=1,
    moe_d_ff=128,
)


def model_step(config: K3Config, batch: int, seq: int, optimizer: bool,
               document_ids: torch.Tensor | None = None) -> Callable[[], None]:
    """One training-mode forward+backward (and MuonAdamW step) on random tokens (with
    ``document_ids``, the packed documents kept apart)."""
    torch.manual_seed(0)
    model = K3Model(config).train()
    opt = MuonAdamW(model.parameter_groups(lr=1e-3, weight_decay=0.1)) if optimizer else None
    x = torch.randint(0, config.vocab_size, (batch, seq + 1),
                      generator=torch.Generator().manual_seed(1))

    def run() -> None:
        _, loss = model(x[:, :-1], x[:, 1:], document_ids=document_ids)
        assert loss is not None
        loss.backward()
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=True)

    return run


def bench_presets(args: argparse.Namespace) -> dict[str, object]:
    lengths = [128, 256] if args.quick else [1024, 4096]
    rounds = 1 if args.quick else args.rounds
    rows, results = [], {}
    for t in lengths:
        hybrid = preset("tiny", max_seq_len=t)
        cases = {"hybrid": model_step(hybrid, 1, t, optimizer=False),
                 "all-MLA": model_step(hybrid.replace(attention="mla"), 1, t, optimizer=False)}
        timings = interleaved(cases, repeats=rounds, warmup=1)
        hyb, mla = timings["hybrid"], timings["all-MLA"]
        ratios = [m / h for h, m in zip(hyb.seconds, mla.seconds)]
        ratio = statistics.median(ratios)
        verdict = ("met" if ratio > 1.0 else "missed") if t == lengths[-1] else ""
        rows.append([str(t), f"{t / hyb.median:,.0f}", f"{t / mla.median:,.0f}", f"{ratio:.2f}",
                     f"{min(ratios):.2f}–{max(ratios):.2f}", verdict])
        results[f"T{t}"] = {"hybrid_s": hyb.seconds, "mla_s": mla.seconds, "ratio": ratio}
    print_table(f"tiny preset forward+backward, batch 1, fp32, {rounds} interleaved rounds",
                ["seq", "hybrid tok/s", "all-MLA tok/s", "hybrid × faster", "min–max",
                 f"faster at {lengths[-1]}"], rows)

    batch, seq = (4, 64) if args.quick else (16, 128)
    timings = interleaved({"tiny (K3)": model_step(preset("tiny"), batch, seq, True),
                           "tiny before K3": model_step(PRE_K3_TINY, batch, seq, True)},
                          repeats=rounds, warmup=1)
    tokens = batch * seq
    print_table(f"demo step (batch {batch} × seq {seq}, forward+backward+MuonAdamW, fp32)",
                ["model", "median ms", "tok/s", "300 steps s", "min–max ms"],
                [[name, f"{tm.median * 1e3:.0f}", f"{tokens / tm.median:,.0f}",
                  f"{300 * tm.median:.0f}", tm.spread()] for name, tm in timings.items()])
    results["demo_step"] = {name: tm.seconds for name, tm in timings.items()}
    return results


# --- loss: chunked vs plain cross-entropy; ckpt: activation checkpointing ---------------


def kept_after_forward(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes the forward ``fn`` allocates that are still alive when it returns (what the
    graph keeps for the backward, plus the loss), from the profiler's net allocations;
    the backward then runs to free them. Deterministic for fixed shapes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = fn()
    loss.backward()
    return int(sum(event.self_cpu_memory_usage for event in prof.key_averages()))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _peak_child(build: str, params: dict[str, object], queue: object) -> None:
    fn = globals()[build](**params)
    fn()  # warm-up: one-time allocations do not count
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    fn()
    queue.put((_rss_kib("VmHWM") - before) * 1024)  # type: ignore[attr-defined]


def peak_rss(build: str, **params: object) -> int:
    """Peak resident-memory growth (bytes) of one forward+backward built by
    ``globals()[build](**params)``, measured alone in a fresh process (Linux only). A
    fixed mmap threshold makes every tensor over 128 KiB its own mapping, returned on
    free, so RSS follows the live tensors instead of glibc's reused heap."""
    import multiprocessing
    import os

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_peak_child, args=(build, params, queue))
    previous = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    try:
        child.start()
    finally:
        if previous is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = previous
    value = int(queue.get(timeout=600))
    child.join()
    return value


def loss_case(vocab: int, tokens: int, d: int, chunk: int) -> Callable[[], torch.Tensor]:
    """The output head + loss on ``tokens`` fp32 hidden states; ``chunk`` 0 = plain."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, d, generator=gen, requires_grad=True)
    weight = (0.02 * torch.randn(vocab, d, generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)

    def run() -> torch.Tensor:
        hidden.grad = weight.grad = None
        if chunk:
            return chunked_cross_entropy(hidden, weight, targets, chunk)
        return F.cross_entropy(F.linear(hidden, weight).float(), targets)

    return run


def loss_step(vocab: int, tokens: int, d: int, chunk: int) -> Callable[[], None]:
    forward = loss_case(vocab, tokens, d, chunk)
    return lambda: forward().backward()  # type: ignore[no-untyped-call]


def bench_loss(args: argparse.Namespace) -> dict[str, object]:
    vocab, d, chunk = (4096, 64, 128) if args.quick else (32768, 384, 512)
    lengths = [256] if args.quick else [1024, 4096]
    rounds = 1 if args.quick else args.rounds
    rows: list[list[str]] = []
    results: dict[str, object] = {}
    for t in lengths:
        kept = {name: kept_after_forward(loss_case(vocab, t, d, c))
                for name, c in (("plain", 0), ("chunked", chunk))}
        peak = {name: peak_rss("loss_step", vocab=vocab, tokens=t, d=d, chunk=c)
                for name, c in (("plain", 0), ("chunked", chunk))}
        timings = interleaved({"plain": loss_step(vocab, t, d, 0),
                               "chunked": loss_step(vocab, t, d, chunk)},
                              repeats=rounds, warmup=1)
        ratio = statistics.median(
            c / p for p, c in zip(timings["plain"].seconds, timings["chunked"].seconds))
        rows.append([str(t), _mib(kept["plain"]), _mib(kept["chunked"]), _mib(peak["plain"]),
                     _mib(peak["chunked"]), f"{timings['plain'].median * 1e3:.0f}",
                     f"{timings['chunked'].median * 1e3:.0f}", f"{ratio:.2f}"])
        results[f"T{t}"] = {"kept_bytes": kept, "peak_rss_bytes": peak, "time_ratio": ratio,
                            **{f"{n}_s": tm.seconds for n, tm in timings.items()}}
    print_table(f"output head + cross-entropy forward+backward, vocab {vocab}, d {d}, fp32, "
                f"chunk {chunk} tokens, {rounds} interleaved rounds",
                ["tokens", "kept plain MiB", "kept chunked MiB", "peak plain MiB",
                 "peak chunked MiB", "plain ms", "chunked ms", "time chunked ÷ plain"], rows)
    return results


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def ckpt_case(name: str, seq: int, mode: str) -> Callable[[], torch.Tensor]:
    """A training forward of preset ``name`` (batch 1) returning the loss."""
    torch.manual_seed(0)
    model = K3Model(preset(name, max_seq_len=seq)).train()
    model.set_activation_checkpointing(mode)
    x = torch.randint(0, model.config.vocab_size, (1, seq + 1),
                      generator=torch.Generator().manual_seed(1))

    def run() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss: torch.Tensor = model(x[:, :-1], x[:, 1:])[1]
        return loss

    return run


def ckpt_step(name: str, seq: int, mode: str) -> Callable[[], None]:
    forward = ckpt_case(name, seq, mode)
    return lambda: forward().backward()  # type: ignore[no-untyped-call]


def bench_ckpt(args: argparse.Namespace) -> dict[str, object]:
    cases = [("tiny", 128)] if args.quick else [("tiny", 1024), ("small", 1024)]
    rounds = 1 if args.quick else args.rounds
    rows: list[list[str]] = []
    results: dict[str, object] = {}
    for name, seq in cases:
        kept = {mode: kept_after_forward(ckpt_case(name, seq, mode)) for mode in ("none", "block")}
        peak = {mode: peak_rss("ckpt_step", name=name, seq=seq, mode=mode)
                for mode in ("none", "block")}
        timings = interleaved({mode: ckpt_step(name, seq, mode) for mode in ("none", "block")},
                              repeats=rounds, warmup=1)
        ratio = statistics.median(
            b / n for n, b in zip(timings["none"].seconds, timings["block"].seconds))
        rows.append([name, str(seq), _mib(kept["none"]), _mib(kept["block"]),
                     f"{kept['none'] / kept['block']:.1f}", _mib(peak["none"]),
                     _mib(peak["block"]), f"{ratio:.2f}"])
        results[f"{name}_T{seq}"] = {"kept_bytes": kept, "peak_rss_bytes": peak,
                                     "time_ratio": ratio,
                                     **{f"{m}_s": tm.seconds for m, tm in timings.items()}}
    print_table(f"activation checkpointing, batch 1 forward+backward, fp32, {rounds} "
                "interleaved rounds", ["preset", "seq", "kept none MiB", "kept block MiB",
                                       "kept ÷", "peak none MiB", "peak block MiB",
                                       "time block ÷ none"], rows)
    return results


# --- documents: the cost of document masking -------------------------------------------


def packed_ids(batch: int, seq: int, seed: int = 2) -> torch.Tensor:
    """Document ids of rows packing documents of 20–300 tokens (uniform)."""
    rng = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths: list[int] = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(20, 301, (1,), generator=rng)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows.append(ids[:seq])
    return torch.stack(rows)


def bench_documents(args: argparse.Namespace) -> dict[str, object]:
    cases = [("demo step", 4, 64, True)] if args.quick else \
        [("demo step", 16, 128, True), ("seq 1024", 1, 1024, False)]
    rounds = 1 if args.quick else args.rounds
    rows, results = [], {}
    for label, batch, seq, optimizer in cases:
        config = preset("tiny", max_seq_len=max(seq, 128))
        ids = packed_ids(batch, seq)
        timings = interleaved({mode: model_step(config, batch, seq, optimizer,
                                                ids if mode == "masked" else None)
                               for mode in ("plain", "masked")}, repeats=rounds, warmup=1)
        ratios = [m / p for p, m in zip(timings["plain"].seconds, timings["masked"].seconds)]
        docs = float(packed_ids(batch, seq).amax(dim=1).float().mean() + 1)
        rows.append([label, f"{batch}×{seq}", f"{docs:.1f}",
                     f"{timings['plain'].median * 1e3:.0f}",
                     f"{timings['masked'].median * 1e3:.0f}",
                     f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}–{max(ratios):.2f}"])
        results[label] = {"ratio": statistics.median(ratios),
                          **{f"{m}_s": tm.seconds for m, tm in timings.items()}}
    print_table(f"document masking, tiny preset, fp32, {rounds} interleaved rounds",
                ["case", "batch", "docs/row", "plain ms", "masked ms", "masked ÷ plain",
                 "min–max"], rows)
    return results


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, object]]] = {
    "kda": bench_kda,
    "presets": bench_presets,
    "loss": bench_loss,
    "ckpt": bench_ckpt,
    "documents": bench_documents,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--only", choices=sorted(SECTIONS), nargs="*", help="sections to run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = {name: fn(args) for name, fn in SECTIONS.items()
               if not args.only or name in args.only}
    write_json(args.json, results)


if __name__ == "__main__":
    main()
