"""Does it train better? Equal-token quality comparisons of the recipe's choices.

Run: ``hatch run bench:quality`` (about 50 minutes on 2 CPU cores; ``--quick`` is the CI smoke
run). Every candidate trains the ``tiny`` preset's shape (or a variant of it) on one corpus
prepared with a byte-level BPE trained on it (default: the built-in corpus; ``--data`` a
folder of your own), for the same number of tokens, through ``k3_trainer.Trainer``. Each
candidate gets its best of a three-value peak-LR sweep (seed 0; extended when the best is
at an edge), then two more seeds at that LR; the table reports the final ``val_bpb`` over
the whole validation split (mean of the seeds and their spread) and training tokens/s.
The comparisons:

- ``optimizer``: MuonAdamW against AdamW alone (every group AdamW), same model;
- ``architecture``: the K3 hybrid (KDA + Gated MLA) against all-MLA and a dense
  llama-style model (GQA, RoPE, SwiGLU, no MoE), at equal active parameters;
- ``attn_res``: block Attention Residuals on against off;
- ``ns_dtype``: Newton–Schulz in bf16 against fp32;
- ``kda_gate_init``: KDA's decay-gate init of torchtitan's and NeMo's K3 ports
  (``dt_bias = 0``: a token keeps ≈ 8% of the state at init) against fla's
  (``dt_bias`` = inverse softplus of a log-uniform dt in [1e-3, 0.1]: ≈ 95%);
- ``recipe``: the shipped defaults against one change each (spectral update scale, no
  weight decay, a 3× longer warmup);
- ``schedule``: the cosine schedule against warmup-stable-decay (WSD, the ``1-sqrt``
  decay) over the last 10% and the last 20% of the run;
- ``mixture``: a mixture of two sources, the corpus (``docs``) and Python's own standard
  library source (``code``, prepared with the corpus's tokenizer), at 0.7/0.3 and 0.3/0.7,
  mixed row by row, with the final ``val_bpb`` of each source beside the mixture's
  (weighted) one;
- ``documents``: document masking (``document_masking``: KDA restarts and attention
  within each document) against none, on the corpus and on the 0.7/0.3 mixture;
- ``muon_variants`` and ``muon_variants_dense``: Muon against NorMuon (``muon_normuon``)
  and NorMuon with cautious weight decay (``cautious_weight_decay``), on the K3 hybrid and
  on the dense llama-style model;
- ``ns_method_bf16``: Newton–Schulz in bf16, the standard iteration against the Gram form
  where ``ns_method="auto"`` takes it (aspect ratio ≥ 2.5; every other row pins the
  standard iteration, ``BASE_MUON``).

Each run's final model is also scored on downstream tasks (``--downstream``, default
ARC-Easy, PIQA and HellaSwag, their first ``--downstream-limit`` documents): a second
table per comparison gives each task's accuracy and gold-answer bits per byte and the
tasks' ``core`` (mean centered accuracy), the seeds' means.

Runs go to ``--workers`` processes of ``--threads`` threads each (the best throughput
on 2 cores), and each finished run is cached as JSON under ``--out-dir``, so an
interrupted benchmark continues where it stopped. The tokens/s column is measured
afterwards, every candidate side by side in one process (the runs themselves shared the
cores with each other). Plots: one per comparison,
``val_bpb`` against tokens and against training seconds (``--plots``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BASE = "K3 (MuonAdamW)"


# The base recipe, pinned rather than read from TrainConfig's defaults, so the table keeps
# meaning what it measured when a default moves (warmup: min(20, steps // 10)); every
# candidate is this plus its own change.
BASE_RECIPE: dict[str, Any] = {"weight_decay": 0.1, "muon_update_scale": "match_rms_adamw",
                               "muon_ns_dtype": "fp32"}
# MuonAdamW options no TrainConfig field sets, pinned the same way: the Newton–Schulz
# iteration every row before Gram Newton–Schulz used (MuonAdamW's default is now "auto").
BASE_MUON: dict[str, Any] = {"ns_method": "standard"}


@dataclass(frozen=True)
class Candidate:
    """One recipe: model overrides on ``tiny``, TrainConfig overrides, the optimizer."""

    name: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "muon_adamw"  # or "adamw": every parameter group AdamW
    gate_init: str = "k3"  # or "fla"
    match_active_by: str | None = None  # a model field tuned to the base's active params
    mixture: tuple[tuple[str, float], ...] | None = None  # (source, weight): docs, code
    muon: dict[str, Any] = field(default_factory=dict)  # MuonAdamW options over BASE_MUON


DENSE = {"attention": "gqa", "mlp": "dense", "activation": "swiglu", "n_kv_heads": 2,
         "attn_res_block_size": 0}  # a dense llama-style model (d_ff matched to K3's active size)
NORMUON = {"muon_normuon": True}
NORMUON_CAUTIOUS = {"muon_normuon": True, "cautious_weight_decay": True}
CANDIDATES = [
    Candidate(BASE),
    Candidate("K3 (AdamW)", optimizer="adamw"),
    Candidate("all-MLA", model={"attention": "mla"}, match_active_by="kv_lora_rank"),
    Candidate("dense GQA (llama-style)", model=DENSE, match_active_by="d_ff"),
    Candidate("no AttnRes", model={"attn_res_block_size": 0}),
    Candidate("NS bf16", train={"muon_ns_dtype": "bf16"}),
    Candidate("KDA gate init: fla", gate_init="fla"),
    Candidate("spectral update scale", train={"muon_update_scale": "spectral"}),
    Candidate("no weight decay", train={"weight_decay": 0.0}),
    Candidate("3x warmup", train={"warmup_steps": "3x"}),
    Candidate("WSD, decay 10%", train={"lr_schedule": "wsd", "decay_fraction": 0.1}),
    Candidate("WSD, decay 20%", train={"lr_schedule": "wsd", "decay_fraction": 0.2}),
    Candidate("docs 0.7 / code 0.3", mixture=(("docs", 0.7), ("code", 0.3))),
    Candidate("docs 0.3 / code 0.7", mixture=(("docs", 0.3), ("code", 0.7))),
    Candidate("K3, documents apart", train={"document_masking": True}),
    Candidate("docs 0.7 / code 0.3, documents apart", mixture=(("docs", 0.7), ("code", 0.3)),
              train={"document_masking": True}),
    Candidate("K3, NorMuon", train=NORMUON),
    Candidate("K3, NorMuon + cautious WD", train=NORMUON_CAUTIOUS),
    Candidate("dense, NorMuon", model=DENSE, match_active_by="d_ff", train=NORMUON),
    Candidate("dense, NorMuon + cautious WD", model=DENSE, match_active_by="d_ff",
              train=NORMUON_CAUTIOUS),
    Candidate("NS bf16, Gram where auto picks it", train={"muon_ns_dtype": "bf16"},
              muon={"ns_method": "auto"}),
]
COMPARISONS = {
    "optimizer": [BASE, "K3 (AdamW)"],
    "architecture": [BASE, "all-MLA", "dense GQA (llama-style)"],
    "attn_res": [BASE, "no AttnRes"],
    "ns_dtype": [BASE, "NS bf16"],
    "kda_gate_init": [BASE, "KDA gate init: fla"],
    "recipe": [BASE, "spectral update scale", "no weight decay", "3x warmup"],
    "schedule": [BASE, "WSD, decay 10%", "WSD, decay 20%"],
    "mixture": ["docs 0.7 / code 0.3", "docs 0.3 / code 0.7"],
    "documents": [BASE, "K3, documents apart", "docs 0.7 / code 0.3",
                  "docs 0.7 / code 0.3, documents apart"],
    "muon_variants": [BASE, "K3, NorMuon", "K3, NorMuon + cautious WD"],
    "muon_variants_dense": ["dense GQA (llama-style)", "dense, NorMuon",
                            "dense, NorMuon + cautious WD"],
    "ns_method_bf16": ["NS bf16", "NS bf16, Gram where auto picks it"],
}
SWEEP_CENTER = 3e-3  # the sweep: these multiples of it (fixed, so the defaults it chose
LR_FACTORS = (1 / 3, 1.0, 3.0)  # can move without moving the sweep)
MAX_EXTENSIONS = 2  # further ×3 steps past an edge best


@dataclass(frozen=True)
class Setup:
    """What every run shares. ``corpus`` identifies the prepared tokens (a digest of the
    manifest's shard checksums); the cache keys on it, not on ``data``'s path."""

    data: str
    corpus: str
    steps: int
    batch_size: int
    seq_len: int
    eval_every: int
    vocab_size: int
    code: str = ""
    """The ``code`` source's dataset (prepared only when a mixture candidate runs)."""
    code_corpus: str = ""
    """Its tokens' digest, as ``corpus`` is the corpus's."""
    downstream: str = ""
    """Downstream tasks scored on each run's final model (comma-separated; "" none)."""
    downstream_limit: int = 0
    """Their first documents scored."""
    eval_batches: int = 0
    """Validation batches per evaluation (0: the whole split; ``--quick`` caps it)."""


# --- one run (in a worker process) ---------------------------------------------------


def _fla_gate_init(model: Any, seed: int) -> None:
    """fla's KDA init: ``dt_bias = softplus⁻¹(dt)``, dt log-uniform in [1e-3, 0.1]."""
    import torch

    from k3_model import KimiDeltaAttention

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, KimiDeltaAttention):
                u = torch.rand(module.dt_bias.shape, generator=generator)
                dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def _k3_ports_gate_init(model: Any, seed: int) -> None:
    """torchtitan's and NeMo's K3 ports: ``dt_bias = 0``."""
    import torch

    from k3_model import KimiDeltaAttention

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, KimiDeltaAttention):
                module.dt_bias.zero_()


_GATE_INITS = {"k3": _k3_ports_gate_init, "fla": _fla_gate_init}


def model_config(candidate: Candidate, vocab_size: int) -> Any:
    """The candidate's K3Config: ``tiny`` with its overrides, active parameters matched."""
    from k3_model import count_parameters, preset

    base = preset("tiny", vocab_size=vocab_size)
    config = base.replace(**candidate.model)
    knob = candidate.match_active_by
    if knob is not None:
        target = count_parameters(base).active

        def gap(value: int) -> int:
            return abs(count_parameters(config.replace(**{knob: value})).active - target)

        config = config.replace(**{knob: min(range(8, 4097, 8), key=gap)})
    return config


def train_config(candidate: Candidate, setup: Setup, lr: float, seed: int,
                 eval_batches: int = 8) -> Any:
    from k3_trainer import TrainConfig

    default = TrainConfig(max_steps=setup.steps, warmup_steps=min(20, setup.steps // 10),
                          **BASE_RECIPE)
    overrides = dict(candidate.train)
    if overrides.get("warmup_steps") == "3x":
        overrides["warmup_steps"] = 3 * default.warmup_steps
    return default.replace(
        batch_size=setup.batch_size, seq_len=setup.seq_len, peak_lr=lr, seed=seed,
        log_interval=setup.steps, eval_interval=setup.eval_every, eval_batches=eval_batches,
        checkpoint_interval=10 * setup.steps, **overrides)


def build(candidate: Candidate, setup: Setup, train: Any, seed: int) -> tuple[Any, Any]:
    """The candidate's model (seeded init, its KDA gate init) and optimizer."""
    import torch

    from k3_model import K3Model
    from k3_optim import MuonAdamW
    from k3_trainer import build_optimizer

    torch.manual_seed(seed)
    model = K3Model(model_config(candidate, setup.vocab_size))
    _GATE_INITS[candidate.gate_init](model, seed)  # explicit: independent of the default
    optimizer = build_optimizer(model, train)
    for group in optimizer.param_groups:  # known-valid values, set as the groups hold them
        if group["use_muon"]:
            group.update({**BASE_MUON, **candidate.muon})
    if candidate.optimizer == "adamw":
        groups = [dict(g, use_muon=False) for g in optimizer.param_groups]
        for group in groups:
            for key in ("num_heads", "flatten"):
                group.pop(key, None)
        optimizer = MuonAdamW(groups, lr=train.peak_lr, weight_decay=train.weight_decay,
                              betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    return model, optimizer


def run_one(candidate: Candidate, setup: Setup, lr: float, seed: int,
            threads: int) -> dict[str, Any]:
    """Train one candidate for ``setup.steps`` steps; return its curve and final numbers."""
    import torch

    from k3_model import count_parameters
    from k3_trainer import Callback, Trainer

    torch.set_num_threads(threads)
    loaders = _loaders(candidate, setup)
    # Every evaluation reads the whole validation split (each source's, for a mixture),
    # unless the setup caps it.
    vals = getattr(loaders[1], "sources", None) or {"": loaders[1]}
    config = model_config(candidate, setup.vocab_size)
    whole = max(1, min((v.num_tokens - 1) // v.tokens_per_batch for v in vals.values()))
    train = train_config(candidate, setup, lr, seed,
                         eval_batches=min(whole, setup.eval_batches or whole))
    model, optimizer = build(candidate, setup, train, seed)

    class Curve(Callback):
        """Training seconds (attempts only, no evaluation) and each evaluation's val_bpb."""

        def __init__(self) -> None:
            self.seconds, self.points, self._start = 0.0, [], 0.0

        def on_attempt_start(self, trainer: Trainer, step: int) -> None:
            self._start = time.perf_counter()

        def on_attempt_end(self, trainer: Trainer, step: int) -> None:
            self.seconds += time.perf_counter() - self._start

        def on_eval_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
            state = trainer.state
            self.points.append({"step": state.step, "tokens": state.tokens_seen,
                                "seconds": round(self.seconds, 2),
                                "val_bpb": record["val_bpb"], "val_loss": record["val_loss"],
                                **({"by_source": {name: part["val_bpb"] for name, part in
                                                  record["val_by_source"].items()}}
                                   if "val_by_source" in record else {})})

    curve = Curve()
    state = Trainer(model, optimizer, loaders, train, callbacks=[curve]).fit()
    if state.step != setup.steps:  # a Ctrl-C stops the Trainer early: not a result
        raise RuntimeError(f"{candidate.name} stopped at step {state.step} of {setup.steps}")
    final = curve.points[-1]
    params = count_parameters(config)
    downstream = _downstream(model, setup, config) if setup.downstream else None
    return {"candidate": candidate.name, "lr": lr, "seed": seed, "steps": state.step,
            "tokens": state.tokens_seen, "train_seconds": round(curve.seconds, 2),
            "tokens_per_s": state.tokens_seen / curve.seconds, "val_bpb": final["val_bpb"],
            **({"val_bpb_by_source": final["by_source"]} if "by_source" in final else {}),
            "finite": math.isfinite(final["val_bpb"]), "curve": curve.points,
            "active_params": params.active, "total_params": params.total,
            "model_overrides": {k: v for k, v in config.to_dict().items()
                                if v != _tiny_default(k, setup.vocab_size)},
            **({"downstream": downstream} if downstream is not None else {})}


def _downstream(model: Any, setup: Setup, config: Any) -> dict[str, Any]:
    """The final model's downstream scores: each task's metrics and ``core``."""
    from k3_trainer.data import load_codec, read_manifest
    from k3_trainer.tasks import DownstreamTasks, summary

    codec = load_codec(Path(setup.data), read_manifest(Path(setup.data)))
    tasks = DownstreamTasks(setup.downstream.split(","), codec, limit=setup.downstream_limit,
                            bos=codec.eod_id)
    return summary(tasks.evaluate(model, vocab_size=config.vocab_size,
                                  max_len=config.max_seq_len))


def _loaders(candidate: Candidate, setup: Setup) -> tuple[Any, Any]:
    """The corpus's loaders, or the candidate's mixture of ``docs`` (the corpus) and
    ``code`` (mixed row by row)."""
    from k3_trainer import TokenDataLoader
    from k3_trainer.data import MixtureLoader, Source

    if candidate.mixture is None:
        return tuple(TokenDataLoader(setup.data, split, setup.batch_size, setup.seq_len)
                     for split in ("train", "val"))
    paths = {"docs": setup.data, "code": setup.code}
    sources = [Source(name, Path(paths[name]), weight) for name, weight in candidate.mixture]
    return tuple(MixtureLoader(sources, split, setup.batch_size, setup.seq_len)
                 for split in ("train", "val"))


def throughput(candidates: list[Candidate], setup: Setup, table: dict[str, dict[str, Any]], *,
               threads: int, steps: int, rounds: int) -> dict[str, float]:
    """Training tokens/s of each candidate at its best LR, measured side by side in this
    process (``steps`` optimizer steps per candidate per round, round-robin, median of
    ``rounds``), so machine load hits all alike; the sweep's own runs shared 2 cores."""
    import torch

    from common import interleaved

    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, setup.vocab_size, (setup.batch_size, setup.seq_len + 1),
                      generator=generator)
    cases = {}
    for candidate in candidates:
        train = train_config(candidate, setup, table[candidate.name]["best_lr"], 0)
        model, optimizer = build(candidate, setup, train, 0)

        def run(model: Any = model, optimizer: Any = optimizer) -> None:
            for _ in range(steps):
                _, loss = model(x[:, :-1], targets=x[:, 1:])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        cases[candidate.name] = run
    timings = interleaved(cases, repeats=rounds, warmup=1)
    tokens = steps * setup.batch_size * setup.seq_len
    return {name: tokens / timing.median for name, timing in timings.items()}


def _tiny_default(name: str, vocab_size: int) -> Any:
    from k3_model import preset

    return getattr(preset("tiny", vocab_size=vocab_size), name)


# --- scheduling, caching, reporting --------------------------------------------------


def lrs_for(candidate: Candidate, default_lr: float, quick: bool) -> list[float]:
    if quick:
        return [default_lr]
    return [round(default_lr * f, 6) for f in LR_FACTORS]


def run_key(candidate: Candidate, setup: Setup, lr: float, seed: int) -> str:
    # Fields added later are left out at their defaults, so earlier cached runs still match.
    shared = {k: v for k, v in asdict(setup).items() if k not in ("data", "code")
              and (k not in ("downstream", "downstream_limit", "eval_batches") or v)}
    if candidate.mixture is not None:
        shared["code_corpus"] = setup.code_corpus
        shared["mixed_by"] = "row"  # batch-level mixing's cached runs do not match
    own = {k: v for k, v in asdict(candidate).items()
           if (k != "mixture" or v is not None) and (k != "muon" or v)}
    blob = json.dumps([own, shared, lr, seed, BASE_RECIPE], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Runs:
    """Finished runs on disk (one JSON per run), so a rerun skips what is done."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.folder / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def put(self, key: str, result: dict[str, Any]) -> None:
        tmp = self.folder / f".{key}.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, self.folder / f"{key}.json")


def schedule(candidates: list[Candidate], setup: Setup, runs: Runs, *, workers: int,
             threads: int, default_lr: float, quick: bool,
             seeds: int) -> dict[str, list[dict[str, Any]]]:
    """Sweep each candidate's LRs (seed 0), then its other seeds at the best LR.

    A sweep whose best LR is at its edge is extended one step further that way (up to
    ``MAX_EXTENSIONS`` times), so every reported best is bracketed by a worse LR on each
    side. A candidate's other seeds are submitted as soon as its sweep is settled, so the
    phases overlap across candidates and no worker waits."""
    done: dict[str, list[dict[str, Any]]] = {c.name: [] for c in candidates}
    sweeps = {c.name: lrs_for(c, default_lr, quick) for c in candidates}
    pending: dict[Future[dict[str, Any]], tuple[Candidate, str]] = {}
    started = time.perf_counter()

    def finished(candidate: Candidate, key: str, result: dict[str, Any]) -> None:
        runs.put(key, result)
        done[candidate.name].append(result)
        count = sum(len(v) for v in done.values())
        print(f"[{count} runs, {time.perf_counter() - started:5.0f} s] {candidate.name} "
              f"lr {result['lr']:g} seed {result['seed']}: val_bpb {result['val_bpb']:.4f}, "
              f"{result['tokens_per_s']:.0f} tok/s", flush=True)
        lrs = sweeps[candidate.name]
        sweep = [r for r in done[candidate.name] if r["seed"] == 0]
        if seeds == 1 or result["seed"] != 0 or len(sweep) < len(lrs):
            return
        best = min(sweep, key=_score)["lr"]
        step = LR_FACTORS[-1] / LR_FACTORS[1]
        edge = step if best == max(lrs) else 1 / step if best == min(lrs) else None
        if edge is not None and len(lrs) < len(LR_FACTORS) + MAX_EXTENSIONS:
            lrs.append(round(best * edge, 6))
            submit(candidate, lrs[-1], 0)
        else:
            for seed in range(1, seeds):
                submit(candidate, best, seed)

    def submit(candidate: Candidate, lr: float, seed: int) -> None:
        key = run_key(candidate, setup, lr, seed)
        cached = runs.get(key)
        if cached is not None:
            finished(candidate, key, cached)
            return
        future = pool.submit(run_one, candidate, setup, lr, seed, threads)
        pending[future] = (candidate, key)

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
    try:
        for candidate in candidates:
            for lr in list(sweeps[candidate.name]):
                submit(candidate, lr, 0)
        while pending:
            future = next(_completed(pending))
            candidate, key = pending.pop(future)
            finished(candidate, key, future.result())
    except BaseException:  # Ctrl-C included: drop the queue, keep what is cached
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return done


def _completed(pending: dict[Future[Any], Any]) -> Iterator[Future[Any]]:
    from concurrent.futures import FIRST_COMPLETED, wait

    finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
    yield from finished


def _score(result: dict[str, Any]) -> float:
    return result["val_bpb"] if result["finite"] else math.inf


def summarize(done: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per candidate: best LR, the seeds' final val_bpb (mean, spread), tokens/s, sweep."""
    table: dict[str, dict[str, Any]] = {}
    for name, results in done.items():
        sweep = sorted((r for r in results if r["seed"] == 0), key=lambda r: r["lr"])
        best = min(sweep, key=_score)
        at_best = [r for r in results if r["lr"] == best["lr"]]
        bpbs = [r["val_bpb"] for r in at_best]
        table[name] = {
            "best_lr": best["lr"], "val_bpb_mean": statistics.fmean(bpbs),
            "val_bpb_spread": max(bpbs) - min(bpbs), "seeds": len(bpbs),
            "tokens_per_s": None,  # side by side, from throughput()
            "sweep": {f"{r['lr']:g}": r["val_bpb"] for r in sweep},
            "active_params": best["active_params"], "model_overrides": best["model_overrides"],
            "by_source": {source: statistics.fmean(r["val_bpb_by_source"][source]
                                                   for r in at_best)
                          for source in best.get("val_bpb_by_source", {})},
            "curve": [(p[0]["tokens"], statistics.fmean(q["val_bpb"] for q in p))
                      for p in zip(*(r["curve"] for r in at_best))],
        }
        if all("downstream" in r for r in at_best):  # the seeds' mean of each number
            scores = [r["downstream"] for r in at_best]
            table[name]["downstream"] = {
                "tasks": {task: {key: statistics.fmean(s["tasks"][task][key] for s in scores)
                                 for key in ("acc", "acc_norm", "bpb", "centered_acc")}
                          for task in scores[0]["tasks"]},
                "core": statistics.fmean(s["core"] for s in scores)}
    return table


def print_tables(table: dict[str, dict[str, Any]]) -> None:
    from common import print_table

    for comparison, names in COMPARISONS.items():
        names = [n for n in names if n in table]
        if len(names) < 2:
            continue
        rows = []
        for name in sorted(names, key=lambda n: table[n]["val_bpb_mean"]):
            t = table[name]
            sweep = ", ".join(f"{lr}: {bpb:.4f}" for lr, bpb in t["sweep"].items())
            rows.append([name, f"{t['val_bpb_mean']:.4f} ± {t['val_bpb_spread'] / 2:.4f}",
                         f"{t['best_lr']:g}", f"{t['tokens_per_s']:.0f}",
                         f"{t['active_params'] / 1e6:.2f} M", sweep])
        sources = sorted({s for n in names for s in table[n]["by_source"]})
        if sources:  # a mixture: each source's val_bpb (mean of the seeds) after the sweep
            for row, name in zip(rows, sorted(names, key=lambda n: table[n]["val_bpb_mean"])):
                found = table[name]["by_source"]  # a candidate on the corpus alone has none
                row[5:5] = [f"{found[s]:.4f}" if s in found else "–" for s in sources]
        print_table(f"quality: {comparison}", ["candidate", "val_bpb (seeds)", "best LR",
                                               "tok/s", "active",
                                               *(f"{s} val_bpb" for s in sources),
                                               "LR sweep (seed 0)"], rows)
        ordered = sorted(names, key=lambda n: table[n]["val_bpb_mean"])
        if all("downstream" in table[n] for n in ordered):
            tasks = list(table[ordered[0]]["downstream"]["tasks"])
            print_table(f"quality: {comparison}, downstream (mean of the seeds)",
                        ["candidate", "val_bpb", *(f"{t} acc / bpb" for t in tasks), "core"],
                        [[n, f"{table[n]['val_bpb_mean']:.4f}",
                          *(f"{table[n]['downstream']['tasks'][t]['acc']:.3f} / "
                            f"{table[n]['downstream']['tasks'][t]['bpb']:.4f}" for t in tasks),
                          f"{table[n]['downstream']['core']:+.4f}"] for n in ordered])
        ranked = sorted(names, key=lambda n: table[n]["val_bpb_mean"])
        if sources:  # each mixture's val_bpb weighs its sources its own way: not comparable
            continue
        for other in ranked[1:]:
            share = tokens_to_reach(table[ranked[0]]["curve"], table[other]["val_bpb_mean"])
            if share is not None:
                print(f"\n{ranked[0]} reaches {other}'s final val_bpb after "
                      f"{share:.0%} of the tokens")


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The share of the run's tokens at which ``curve`` (tokens, val_bpb) first reaches
    ``target`` (linear between evaluations), or None if it never does."""
    for (t0, b0), (t1, b1) in zip([(0, math.inf), *curve], curve):
        if b1 <= target:
            start = t1 if math.isinf(b0) else t0 + (b0 - target) / (b0 - b1) * (t1 - t0)
            return start / curve[-1][0]
    return None


def plot(done: dict[str, list[dict[str, Any]]], table: dict[str, dict[str, Any]],
         folder: Path) -> list[Path]:
    """One figure per comparison: mean val_bpb of the best-LR seeds against tokens and
    against training seconds, i.e. tokens over the side-by-side tokens/s (the runs' own
    clocks shared the cores with other runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for comparison, names in COMPARISONS.items():
        names = [n for n in names if n in table]
        if len(names) < 2:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        for name in names:
            runs = [r for r in done[name] if r["lr"] == table[name]["best_lr"]]
            points = list(zip(*(r["curve"] for r in runs)))
            tokens = [p[0]["tokens"] / 1e6 for p in points]
            seconds = [p[0]["tokens"] / table[name]["tokens_per_s"] for p in points]
            bpb = [statistics.fmean(q["val_bpb"] for q in p) for p in points]
            label = f"{name} (lr {table[name]['best_lr']:g})"
            axes[0].plot(tokens, bpb, marker=".", label=label)
            axes[1].plot(seconds, bpb, marker=".", label=label)
        axes[0].set_xlabel("training tokens (M)")
        axes[1].set_xlabel("training seconds (at the side-by-side tokens/s)")
        axes[0].set_ylabel("validation bits per byte")
        low = min(min(q["val_bpb"] for r in done[n] for q in r["curve"]) for n in names)
        axes[0].set_ylim(low - 0.05, low + 1.0)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"bench:quality, {comparison}")
        fig.tight_layout()
        path = folder / f"quality-{comparison}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: a few steps, one LR, one seed, 4 "
                        "validation batches")
    parser.add_argument("--data", type=Path, default=None,
                        help="a folder (or file) of text to prepare (default: built-in corpus)")
    parser.add_argument("--bpe", type=int, default=2048, help="BPE vocabulary to train")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3,
                        help="seeds at each candidate's best LR (seed 0 included)")
    parser.add_argument("--only", nargs="*", help="candidate names to run (default: all)")
    parser.add_argument("--downstream", default="arc_easy,piqa,hellaswag",
                        help="tasks scored on each run's final model ('' for none)")
    parser.add_argument("--downstream-limit", type=int, default=300,
                        help="documents per downstream task")
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results" / "quality",
                        help="finished runs are cached here (JSON per run)")
    parser.add_argument("--plots", type=Path, default=HERE / "figures")
    parser.add_argument("--json")
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - {c.name for c in CANDIDATES})
    if unknown:
        known = ", ".join(repr(c.name) for c in CANDIDATES)
        parser.error(f"--only: unknown candidate(s) {', '.join(map(repr, unknown))}; "
                     f"known: {known}")
    if args.quick:
        args.steps, args.batch_size, args.seq_len = 10, 2, 64  # WSD 10%: one decay step
    with tempfile.TemporaryDirectory(prefix="k3-quality-") as scratch:
        try:
            run(args, Path(scratch))
        except KeyboardInterrupt:
            where = "nothing is kept (--quick)" if args.quick else f"kept in {args.out_dir}"
            print(f"\ninterrupted; finished runs are {where}, and a rerun continues from them")
            raise SystemExit(130) from None


def run(args: argparse.Namespace, scratch: Path) -> None:
    from k3_trainer import prepare_dataset
    from k3_trainer.data.options import PrepareOptions

    data = scratch / "data"
    start = time.perf_counter()
    manifest = prepare_dataset([args.data] if args.data else [], data,
                               PrepareOptions(train_tokenizer=args.bpe))
    splits = manifest["split_stats"]
    print(f"prepared {args.data or 'the built-in corpus'} with a {args.bpe} BPE in "
          f"{time.perf_counter() - start:.1f} s: {splits['train']['tokens']:,} train tokens, "
          f"{splits['val']['tokens']:,} validation tokens", flush=True)
    vocab = -(-manifest["vocab_size"] // 128) * 128
    candidates = [c for c in CANDIDATES if not args.only or c.name in args.only]
    code, code_corpus = "", ""
    if any(c.mixture for c in candidates):
        code_manifest = prepare_code(scratch, data, int(splits["train"]["bytes"]))
        code, code_corpus = str(scratch / "code"), _digest(code_manifest)
    setup = Setup(str(data), _digest(manifest), args.steps, args.batch_size, args.seq_len,
                  eval_every=max(1, args.steps // (2 if args.quick else 6)),  # quick: 2 evals
                  vocab_size=vocab, code=code,
                  code_corpus=code_corpus, downstream=args.downstream,
                  downstream_limit=2 if args.quick else args.downstream_limit,
                  eval_batches=4 if args.quick else 0)
    epochs = args.steps * args.batch_size * args.seq_len / splits["train"]["tokens"]
    print(f"each run: {args.steps} steps of {args.batch_size}×{args.seq_len} tokens "
          f"({epochs:.1f} epochs of the training split)", flush=True)
    runs = Runs(scratch / "runs" if args.quick else args.out_dir)
    done = schedule(candidates, setup, runs, workers=args.workers, threads=args.threads,
                    default_lr=SWEEP_CENTER, quick=args.quick,
                    seeds=1 if args.quick else args.seeds)
    table = summarize(done)
    start = time.perf_counter()
    measured = throughput(candidates, setup, table, threads=args.threads,
                          steps=1 if args.quick else 5, rounds=1 if args.quick else 5)
    for name, value in measured.items():
        table[name]["tokens_per_s"] = value
    print(f"throughput measured side by side in {time.perf_counter() - start:.0f} s")
    print_tables(table)
    plots = plot(done, table, scratch / "plots" if args.quick else args.plots)
    shown = "drawn, not kept (--quick)" if args.quick else ", ".join(str(p) for p in plots)
    print(f"\nplots: {shown}")
    if args.json:
        from common import write_json

        write_json(args.json, {"setup": asdict(setup), "epochs": epochs,
                               "candidates": table, "runs": done})


def _digest(manifest: dict[str, Any]) -> str:
    """The prepared tokens' identity: a digest of their shards' checksums."""
    shards = [s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]]
    return hashlib.sha256(" ".join(shards).encode()).hexdigest()[:16]


def prepare_code(scratch: Path, docs: Path, size: int) -> dict[str, Any]:
    """The ``code`` source: Python's standard library modules (sorted by path, as many as
    make about ``size`` bytes), prepared with the corpus's tokenizer into
    ``scratch/code``."""
    import sysconfig

    from k3_trainer import prepare_dataset
    from k3_trainer.data.options import PrepareOptions

    folder, total = scratch / "code-text", 0
    folder.mkdir()
    for number, path in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))):
        text = path.read_text(encoding="utf-8", errors="replace")
        (folder / f"{number:04d}.txt").write_text(text, encoding="utf-8")
        total += len(text.encode())
        if total >= size:
            break
    manifest = prepare_dataset([folder], scratch / "code",
                               PrepareOptions(tokenizer=str(docs / "tokenizer.json")))
    stats = manifest["split_stats"]
    print(f"code source: {total:,} bytes of the standard library, {stats['train']['tokens']:,} "
          f"train and {stats['val']['tokens']:,} validation tokens", flush=True)
    return manifest


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
