"""Worker processes for test_context_parallel_ranks.py (a module, so spawned children import it).

Four gloo ranks run every case of ``RUNS`` in order: a case on all four (context parallel
4), or two cases at once on the pairs {0, 1} and {2, 3} (context parallel 2). Each rank
feeds its contiguous slice of one global batch (and of its document ids) to the model
with ``set_context_parallel``, the balancer gathering over the same group, runs a forward
and backward of its slice's mean loss, and saves what the test compares with one process:
the slice's loss and logits, its parameter gradients, the balancer biases and the QK-Clip
maxima it observed.
"""

from __future__ import annotations

import copy
import datetime
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3_model import K3Config, K3Model
from k3_model.context_parallel import ContextParallel
from k3_model.kda import KimiDeltaAttention
from k3_model.moe import MoE
from k3_qkclip import QKClip, QKClipPolicy

BATCH, SEQ, VOCAB = 2, 72, 64  # slices of 36 (CP 2) and 18 (CP 4): no multiple of 16
# (run, group, case) with case = (kind, documents, activation checkpointing); "pair"
# runs the first case on ranks {0, 1} and the second on {2, 3}.
RUNS: list[tuple[str, str, tuple[tuple[str, bool, bool], ...]]] = [
    ("cp4-k3-docs", "all", (("k3", True, False),)),
    ("cp4-k3-ckpt", "all", (("k3", False, True),)),
    ("cp4-mla-docs", "all", (("mla", True, False),)),
    ("cp4-gqa", "all", (("gqa", False, False),)),
    ("cp4-gqa-docs", "all", (("gqa", True, True),)),
    ("cp4-kda-docs", "all", (("kda", True, False),)),
    ("cp4-kda", "all", (("kda", False, False),)),
    ("cp4-kda64-docs", "all", (("kda64", True, False),)),
    ("cp2-a", "pair", (("k3", True, True), ("k3", False, False))),
    ("cp2-b", "pair", (("mla", False, False), ("mla", True, True))),
    ("cp2-c", "pair", (("gqa", True, False), ("kda", True, False))),
    ("cp2-d", "pair", (("kda", False, False), ("gqa", False, True))),
]


def configs() -> dict[str, Any]:
    """Three-layer fp32 models (the hybrid: KDA, KDA, Gated NoPE MLA), as conftest's."""
    common = dict(vocab_size=VOCAB, d_model=48, n_layers=3, n_heads=4, max_seq_len=SEQ,
                  d_ff=96, mlp="moe", n_dense_layers=1, n_experts=4, moe_top_k=2,
                  moe_d_ff=32)
    mla = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
    return {
        "k3": K3Config(**common, **mla, attention="hybrid", kda_chunk_size=16,
                       attn_res_block_size=1, moe_latent_dim=32, activation="situ"),
        "mla": K3Config(**common, **mla, attention="mla"),
        "gqa": K3Config(**common, attention="gqa", n_kv_heads=2),
        "kda": "kda",
        "kda64": "kda64",
    }


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


def document_ids() -> torch.Tensor:
    """Documents that cross the slice boundaries (18, 36, 54), one that starts exactly at
    36 (a slice start for both degrees), and a one-token document."""
    bounds = ([0, 10, 36, 40, SEQ], [0, 50, 51, SEQ])
    ids = torch.zeros(BATCH, SEQ, dtype=torch.int64)
    for row, edges in enumerate(bounds):
        for doc, (a, b) in enumerate(itertools.pairwise(edges)):
            ids[row, a:b] = 100 * row + doc
    return ids


def build(config: Any) -> torch.nn.Module:
    """The model (or, for ``"kda"``/``"kda64"``, one KDA layer in fp32/fp64) every rank
    and the reference start from."""
    torch.manual_seed(0)
    if config in ("kda", "kda64"):
        layer = KimiDeltaAttention(48, 4, 12, chunk_size=16, backend="torch")
        return layer.double() if config == "kda64" else layer
    return K3Model(config)


def layer_input(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, 48, generator=torch.Generator().manual_seed(5)).to(dtype)


def layer_weight(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, 48, generator=torch.Generator().manual_seed(6)).to(dtype)


def run_case(model: torch.nn.Module, start: int, stop: int, documents: bool,
             cp: ContextParallel | None) -> dict[str, Any]:
    """Forward and backward of the tokens [start, stop) (all of them in one process)."""
    ids = document_ids()[:, start:stop] if documents else None
    if isinstance(model, KimiDeltaAttention):
        dtype = model.q_proj.weight.dtype
        x = layer_input(dtype)[:, start:stop].requires_grad_()
        docs = None
        if documents:
            from k3_model.documents import Documents
            docs = Documents.from_ids(ids, tuple(ids.shape), (16,)) if cp is None \
                else cp.documents(ids, (16,))
        out = model(x, docs)
        loss = (out * layer_weight(dtype)[:, start:stop]).sum() / (BATCH * SEQ)
        loss.backward()
        return {"loss": loss.detach(), "out": out.detach(), "x_grad": x.grad,
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    data = batch()[:, start:stop + 1]
    with QKClip(model, QKClipPolicy(enabled=False)) as clip:
        logits, loss = model(data[:, :-1], data[:, 1:], document_ids=ids)
        maxima = {n: v.clone() for n, v in clip.max_logits().items()}
    loss.backward()
    return {"loss": loss.detach(), "out": logits.detach(), "maxima": maxima,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None},
            "biases": {n: m.balancer.bias.clone() for n, m in model.named_modules()
                       if isinstance(m, MoE)}}


def worker(rank: int, world: int, init: str, out: str, configs: dict[str, Any]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    try:
        groups = {"all": dist.new_group(list(range(world))),
                  "pair": [dist.new_group([0, 1]), dist.new_group([2, 3])]}
        results: dict[str, Any] = {}
        for name, group_name, cases in RUNS:
            if group_name == "all":
                group, case = groups["all"], cases[0]
            else:
                group, case = groups["pair"][rank // 2], cases[rank // 2]
            kind, documents, checkpointing = case
            cp_rank, size = dist.get_rank(group), dist.get_world_size(group)
            model = build(configs[kind])
            cp = ContextParallel(group)
            if isinstance(model, K3Model):
                model.set_context_parallel(group)

                def gather_rows(t: torch.Tensor, group: Any = group, size: int = size
                                ) -> torch.Tensor:
                    parts = [torch.empty_like(t) for _ in range(size)]
                    dist.all_gather(parts, t.contiguous(), group=group)
                    return torch.cat(parts)

                model.set_balancer_gather(gather_rows)
                if checkpointing:
                    model.set_activation_checkpointing("block")
            else:
                model.context_parallel = cp
            n = SEQ // size
            results[name] = {"case": case, "size": size, "rank": cp_rank,
                             **run_case(model, cp_rank * n, (cp_rank + 1) * n, documents, cp)}
        # Slices of different lengths are refused on every rank, with one line.
        model = build(configs["k3"])
        model.set_context_parallel(groups["all"])
        twin = copy.deepcopy(model)  # e.g. an evaluation copy: the same group
        results["copy_shares_group"] = (twin.context_parallel is model.context_parallel
                                        and twin.layers[0].attn.context_parallel
                                        is model.context_parallel)
        try:
            model(batch()[:, : 16 + 2 * rank])
        except ValueError as error:
            results["unequal"] = str(error)
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
