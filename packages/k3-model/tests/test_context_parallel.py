"""Context parallelism in one process: the state-passing algebra, the slice layouts and the
launch-time refusals. The ranks themselves are in test_context_parallel_ranks.py.

The slices here run one after another through the very functions the ranks use
(``slice_summary``, ``carry_in``, ``settle``), in fp64 against the step-by-step
recurrence over the whole sequence: outputs and every input gradient, with and without
documents crossing the slice boundaries.
"""

from __future__ import annotations

import pytest
import torch

from k3_model import K3Config, preset
from k3_model.context_parallel import check_context_parallel
from k3_model.documents import Documents
from k3_model.kda import l2_normalize, recurrent_kda
from k3_model.state_passing import carry_in, kda_over_slices, settle, slice_summary

B, H, K, V = 2, 3, 8, 6


def _inputs(t: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = l2_normalize(randn(B, t, H, K)), l2_normalize(randn(B, t, H, K))
    g = -5.0 * torch.sigmoid(randn(B, t, H, K))
    return [x.requires_grad_() for x in (q, k, randn(B, t, H, V), g,
                                         torch.sigmoid(randn(B, t, H)))]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9),
                         dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), inputs)


@pytest.mark.parametrize("slices", [2, 3, 4, 6])
def test_slices_chained_equal_the_whole_sequence_fp64(slices):
    """72 tokens in slices of 36, 24, 18 and 12 with chunks of 16: slices that are no
    multiple of the chunk, and slices shorter than one."""
    inputs = _inputs(72)
    want, _ = recurrent_kda(*inputs, scale=K**-0.5)
    got = kda_over_slices(*inputs, slices, scale=K**-0.5, chunk_size=16, gate_lower_bound=-5.0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(_grads(got, inputs), _grads(want, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_summary_is_the_final_state_and_the_transition():
    """``[S₀ | M]``: the final state from zero, and the map an incoming state goes through
    (checked against the recurrence from a random incoming state)."""
    q, k, v, g, beta = (x.detach() for x in _inputs(20))
    _, _, summary = slice_summary(q, k, v, g, beta, scale=K**-0.5, chunk_size=16)
    start = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(4),
                        dtype=torch.float64)
    _, final = recurrent_kda(q, k, v, g, beta, initial_state=start, output_final_state=True)
    s0, m = summary.split([V, K], dim=-1)
    torch.testing.assert_close(torch.matmul(m, start) + s0, final, rtol=0, atol=1e-12)


def _slices_with_documents(inputs: list[torch.Tensor], ids: torch.Tensor, slices: int,
                           chunk: int) -> torch.Tensor:
    """What each rank's KDA layer does with documents, one slice after another."""
    t = ids.shape[1]
    n = t // slices
    parts = []
    for r in range(slices):
        docs = Documents.from_ids(ids, tuple(ids.shape), (chunk,), start=r * n, length=n)
        packing = docs.packing(chunk)
        packed = [packing.pack(x[:, r * n:(r + 1) * n]) for x in inputs]
        o0, reads, summary = slice_summary(*packed, scale=K**-0.5, chunk_size=chunk,
                                           restart=packing.restart)
        parts.append((packing.unpack(o0), packing.unpack(reads), summary))
    summaries = [summary for _, _, summary in parts]
    return torch.cat([settle(o0, reads, carry_in(summaries, r), torch.float64)
                      for r, (o0, reads, _) in enumerate(parts)], dim=1)


@pytest.mark.parametrize("slices", [2, 4])
def test_documents_across_slice_boundaries_fp64(slices):
    """Each document gets its own recurrence from zero, wherever it starts: inside a
    slice, exactly at a slice's first token (36), or on an earlier rank (0–50 over 18 and
    36); a one-token document too."""
    ids = torch.tensor([[0] * 10 + [1] * 26 + [2] * 4 + [3] * 32,
                        [0] * 50 + [1] + [2] * 21])
    inputs = _inputs(72, seed=1)
    want = torch.empty(B, 72, H, V, dtype=torch.float64)
    for b in range(B):
        for d in ids[b].unique():
            where = (ids[b] == d).nonzero().flatten()
            alone, _ = recurrent_kda(*(x[b:b + 1, where] for x in inputs), scale=K**-0.5)
            want[b, where] = alone[0]
    got = _slices_with_documents(inputs, ids, slices, 16)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, c in zip(_grads(got, inputs), _grads(want, inputs), strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-11)


def test_every_rank_reaches_the_gathers_backward():
    """Rank 0 has no incoming state, yet the all-gather's backward is a collective every
    rank must reach: the gathered summaries (one tensor, as the gather returns them) get
    a gradient on every rank, zero where a slice does not feed this one."""
    gathered = torch.randn(3, B, H, K, V + K, dtype=torch.float64, requires_grad=True)
    for rank in range(3):
        (grad,) = torch.autograd.grad(carry_in(gathered.unbind(0), rank).sum(), gathered)
        assert [bool(g.abs().sum() > 0) for g in grad] == [j < rank for j in range(3)]


def test_slice_documents_count_positions_from_the_document_start():
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    docs = Documents.from_ids(ids, (2, 24), (16,), start=12, length=6)
    assert docs.positions.tolist() == [[2, 3, 4, 5, 6, 7], [12, 13, 14, 15, 16, 17]]
    assert not docs.starts.any()  # no document begins in the slice
    assert tuple(docs.mask.shape) == (2, 1, 6, 18)  # this slice's and the earlier keys
    assert docs.mask[0, 0, 0].nonzero().flatten().tolist() == list(range(10, 13))
    assert docs.mask[1, 0, -1].all()
    assert not docs.packing(16).restart.any()  # the incoming state is kept
    whole = Documents.from_ids(ids, (2, 24), (16,))
    assert torch.equal(whole.mask, Documents.from_ids(ids, (2, 24), (16,), start=0,
                                                      length=24).mask)


def test_a_document_starting_at_the_slice_start_restarts_the_state():
    ids = torch.tensor([[0] * 12 + [1] * 12])
    docs = Documents.from_ids(ids, (1, 24), (16,), start=12, length=12)
    assert docs.starts[0, 0] and docs.packing(16).restart[0, 0]


@pytest.mark.parametrize("seq_len, cp, match", [
    (96, 5, "not divisible by --context-parallel 5"),
    (96, 4, "less than one KDA chunk"),
    (512, 2, "exceeds K3Config.max_seq_len"),
    (96, 0, "must be a positive int"),
])
def test_launch_refusals_are_one_line(seq_len, cp, match):
    config = preset("tiny", max_seq_len=256)  # KDA chunks of 32
    with pytest.raises(ValueError, match=match) as error:
        check_context_parallel(config, seq_len, cp)
    assert "\n" not in str(error.value)


def test_what_the_planner_may_launch():
    check_context_parallel(preset("tiny"), 256, 8)  # slices of exactly one chunk
    check_context_parallel(preset("tiny"), 256, 1)
    # Without KDA layers a slice only needs to exist.
    check_context_parallel(K3Config(attention="mla", max_seq_len=64), 64, 16)
