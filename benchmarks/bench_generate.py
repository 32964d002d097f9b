"""Decoding with the cache against recomputing the prefix, and against transformers.

Per model, context length and batch, interleaved in one process: decode tokens/s with
K3Model's cache (KDA's recurrent state and conv tail, MLA's latents; ``forward_cached``
one token per sequence per step) against recomputing the forward over the whole context
for every token (what ``k3-train sample`` did before), and, for the Kimi-Linear-shaped
model, against transformers' own ``KimiLinearForCausalLM`` on the same weights decoding
with its cache (its CPU path: pure-torch fallbacks). Also the prefill tokens/s, and the
cache bytes per sequence split into KDA state (constant) and MLA latents (linear), as
measured and as :func:`k3_model.cache.cache_bytes_formula` computes them.

    python benchmarks/bench_generate.py                  # contexts 256, 1024, 4096; batch 1, 8
    python benchmarks/bench_generate.py --quick          # context 256, batch 1 (smoke test)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from common import print_table, write_json
from k3_model import K3Model, preset
from k3_model.cache import cache_bytes_formula
from k3_model.hub import save_pretrained


def _model(name: str, max_len: int) -> K3Model:
    torch.manual_seed(0)
    return K3Model(preset(name, max_seq_len=max_len, kda_backend="torch")).eval()


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _transformers(model: K3Model, root: Path):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    save_pretrained(model, root / "hf", overwrite=True)
    return AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()


@torch.no_grad()
def measure(model: K3Model, context: int, batch: int, steps: int, recompute_steps: int,
            hf=None) -> dict[str, object]:
    x = torch.randint(0, model.config.vocab_size, (batch, context + steps),
                      generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    prefill = _seconds(lambda: model.forward_cached(x[:, :context], cache))
    measured = {k: v // batch for k, v in cache.nbytes().items()}
    cached = _seconds(lambda: [model.forward_cached(x[:, i:i + 1], cache)
                               for i in range(context, context + steps)])
    recompute = _seconds(lambda: [model(x[:, :i + 1])
                                  for i in range(context, context + recompute_steps)])
    row: dict[str, object] = {
        "context": context, "batch": batch,
        "prefill_tokens_per_s": batch * context / prefill,
        "decode_tokens_per_s": batch * steps / cached,
        "recompute_tokens_per_s": batch * recompute_steps / recompute,
        "cache_bytes": measured,
        "formula_bytes": cache_bytes_formula(model.config, context),
    }
    if hf is not None:
        out = hf(input_ids=x[:, :context], use_cache=True)
        past = out.past_key_values
        start = time.perf_counter()
        for i in range(context, context + steps):
            past = hf(input_ids=x[:, i:i + 1], past_key_values=past, use_cache=True
                      ).past_key_values
        row["transformers_tokens_per_s"] = batch * steps / (time.perf_counter() - start)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--contexts", type=int, nargs="*")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--steps", type=int, default=None, help="cached decode steps")
    parser.add_argument("--json")
    args = parser.parse_args()
    contexts = args.contexts or ([256] if args.quick else [256, 1024, 4096])
    batches = args.batches or ([1] if args.quick else [1, 8])
    steps = args.steps or (4 if args.quick else 16)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tiny", "kimi-linear-tiny"):
            model = _model(name, max(contexts) + steps + 1)
            hf = _transformers(model, Path(tmp)) if name == "kimi-linear-tiny" else None
            for context in contexts:
                for batch in batches:
                    recompute_steps = 4 if context * batch <= 2048 else 2
                    row = measure(model, context, batch, steps, recompute_steps, hf)
                    results.append({"model": name, **row})
                    print(f"{name} context {context} batch {batch}: done", flush=True)
    rows = []
    for r in results:
        decode, recompute = r["decode_tokens_per_s"], r["recompute_tokens_per_s"]
        hf_rate = r.get("transformers_tokens_per_s")
        rows.append([r["model"], r["context"], r["batch"], f"{decode:,.0f}", f"{recompute:,.1f}",
                     f"{decode / recompute:,.0f}×",
                     "–" if hf_rate is None else f"{hf_rate:,.1f} ({decode / hf_rate:,.1f}×)",
                     f"{r['prefill_tokens_per_s']:,.0f}"])
    print_table(f"Decode tokens/s, fp32, {steps} cached steps (interleaved per row)",
                ["model", "context", "batch", "cached", "recompute", "speed-up",
                 "transformers (ours ×)", "prefill tok/s"], rows)
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
    write_json(args.json, {"generate": results})


if __name__ == "__main__":
    main()
