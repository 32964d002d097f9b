"""Context parallelism on 4 CPU ranks (gloo) equals one process.

One spawn of four ranks runs every case of cp_workers.RUNS: context parallel 4 over all
of them and 2 over each pair, for the K3 hybrid (KDA + Gated NoPE MLA, Attention
Residuals, LatentMoE), all-MLA (RoPE), GQA (RoPE, grouped heads) and a KDA layer alone;
with and without documents that cross the slice boundaries, with and without activation
checkpointing; slices of 36 and 18 tokens (KDA chunks of 16). Compared in fp32 with the
whole batch in one process: the loss (mean of the equal slices' means), the logits (or
layer outputs) slice by slice, every gradient (the sum over ranks of each rank's
gradient of its slice's share of the loss), the balancer biases and the QK-Clip maxima
(MAX over the ranks).
"""

from __future__ import annotations

import time

import cp_workers
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch without distributed"),
              # one launch at a time, as every module that starts ranks (tests/README.md)
              pytest.mark.xdist_group("torchrun")]

WORLD, TIMEOUT_S = 4, 300


def _close(got: torch.Tensor, want: torch.Tensor, kind: str, name: str = "") -> None:
    """fp32 models: elementwise within 1e-5 relative (1e-6 absolute). The fp32 KDA layer
    alone: within 1e-5 of the output's scale (its one-process fp32 result is itself
    2.4e-6 from fp64 on outputs of size ≈ 1: the chunks fall elsewhere in the slices).
    The fp64 layer: 1e-6 of the scale (its outputs agree to 2e-8 of it; its decay gate is
    fp32 by design, so the gate's gradients sum fp32 terms in another order: 1e-7)."""
    scale = float(want.abs().max())
    if kind == "kda":
        tolerance = dict(rtol=1e-5, atol=1e-5 * scale)
    elif kind == "kda64":
        tolerance = dict(rtol=0.0, atol=1e-6 * scale)
    else:
        tolerance = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, want, **tolerance, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def configs():
    return cp_workers.configs()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, configs) -> list[dict]:
    out = tmp_path_factory.mktemp("cp")
    ctx = mp.start_processes(cp_workers.worker,
                             args=(WORLD, str(out / "init"), str(out), configs),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"context-parallel workers did not finish in {TIMEOUT_S} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


_REFERENCES: dict[tuple, dict] = {}


def _reference(configs, kind: str, documents: bool) -> dict:
    key = (kind, documents)
    if key not in _REFERENCES:
        model = cp_workers.build(configs[kind])
        _REFERENCES[key] = cp_workers.run_case(model, 0, cp_workers.SEQ, documents, None)
    return _REFERENCES[key]


def _members(ranks: list[dict], run: str) -> list[list[dict]]:
    """The results of ``run`` grouped by CP group (one group, or the two pairs), each
    group's in CP-rank order."""
    size = ranks[0][run]["size"]
    groups = [ranks[i:i + size] for i in range(0, len(ranks), size)]
    return [sorted(group, key=lambda r: r[run]["rank"]) for group in groups]


RUN_NAMES = [name for name, _, _ in cp_workers.RUNS]


@pytest.mark.parametrize("run", RUN_NAMES)
def test_context_parallel_equals_one_process(run, ranks, configs):
    for group in _members(ranks, run):
        results = [r[run] for r in group]
        kind, documents, _ = results[0]["case"]
        want = _reference(configs, kind, documents)
        size = len(results)
        if kind.startswith("kda"):  # the ranks' shares of one sum; the input's gradient
            _close(sum(r["loss"] for r in results), want["loss"], kind, "loss")
            _close(torch.cat([r["x_grad"] for r in results], 1), want["x_grad"], kind, "x")
        else:  # the mean of the equal slices' mean losses
            _close(sum(r["loss"] for r in results) / size, want["loss"], kind, "loss")
        _close(torch.cat([r["out"] for r in results], 1), want["out"], kind, "output")
        assert set(results[0]["grads"]) == set(want["grads"])
        for name, grad in want["grads"].items():
            total = sum(r["grads"][name] for r in results)
            _close(total if kind.startswith("kda") else total / size, grad, kind, name)
        for name, bias in want.get("biases", {}).items():
            for r in results:  # solved from every rank's tokens: the one-process bias
                _close(r["biases"][name], bias, kind, name)
        for name, maxima in want.get("maxima", {}).items():
            observed = torch.stack([r["maxima"][name] for r in results]).amax(0)
            _close(observed, maxima, kind, name)


def test_every_case_ran_with_documents_across_boundaries(ranks):
    """The runs cover each model kind at both degrees, with and without documents."""
    seen = {(r[run]["case"][0], r[run]["case"][1], r[run]["size"])
            for r in ranks for run in RUN_NAMES}
    for kind in ("k3", "mla", "gqa", "kda"):
        for documents in (True, False):
            for size in (2, 4):
                if (kind, documents, size) != ("mla", False, 4):
                    assert (kind, documents, size) in seen, (kind, documents, size)
    starts = cp_workers.document_ids().diff(dim=1).ne(0).nonzero()[:, 1] + 1
    assert 36 in starts.tolist()  # a document starts exactly at a slice start


def test_slices_of_different_lengths_are_refused_on_every_rank(ranks):
    for r in ranks:
        assert "equal slice" in r["unequal"] and "\n" not in r["unequal"]


def test_a_deep_copy_of_the_model_keeps_its_group(ranks):
    assert all(r["copy_shares_group"] for r in ranks)
