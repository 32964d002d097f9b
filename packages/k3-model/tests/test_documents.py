"""Documents kept apart: with ``document_ids`` every layer kind (KDA with its convolution,
MLA with and without RoPE, GQA, Attention Residuals, MoE) gives each document exactly the
outputs it gets when run alone, for documents not aligned to KDA chunks; gradients flow,
QK-Clip observes only the visible pairs, and bad ids are refused."""

from __future__ import annotations

import pytest
import torch
from conftest import small_model, tokens

from k3_model import K3Model
from k3_model.documents import Documents
from k3_model.kda import chunk_kda, recurrent_kda

# Lengths of the documents packed into each row: none aligned to a chunk of 16, one
# longer than a chunk, one of a single token, one row a single document.
ROWS = ([5, 1, 19, 7], [32])
T = 32


def _ids(rows: tuple[list[int], ...] = ROWS) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))
                        for r in rows])


def _alone(model: K3Model, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each document's logits from a forward over that document alone, in place."""
    out = torch.empty(*x.shape, model.config.vocab_size)
    for b in range(x.shape[0]):
        for d in ids[b].unique():
            where = (ids[b] == d).nonzero().flatten()
            out[b, where] = model(x[b:b + 1, where])[0][0]
    return out


@pytest.mark.parametrize("kind", ["hybrid", "k3", "mla", "mla_qlora", "gqa", "mha"])
def test_every_document_gets_the_outputs_it_gets_alone(kind):
    model = small_model(kind, max_seq_len=T).eval()
    x, ids = tokens(2, T), _ids()
    with torch.no_grad():
        masked, _ = model(x, document_ids=ids)
        alone = _alone(model, x, ids)
        packed, _ = model(x)
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    # ...and without the ids the later documents do see the earlier ones.
    assert (packed[0, 6:] - alone[0, 6:]).abs().max() > 1e-3


def test_one_document_per_row_is_the_plain_forward():
    model = small_model("k3", max_seq_len=T).eval()
    x = tokens(2, T)
    with torch.no_grad():
        torch.testing.assert_close(model(x, document_ids=torch.zeros(2, T, dtype=torch.long))[0],
                                   model(x)[0], rtol=1e-5, atol=1e-5)


def test_training_loss_and_gradients_match_the_documents_alone():
    # Dense MLPs: a training forward updates the MoE balancer, which would route the
    # documents-alone forwards that follow with another bias.
    model = small_model("hybrid", max_seq_len=T, mlp="dense", attn_res_block_size=1)
    x, ids = tokens(2, T), _ids()
    y = tokens(2, T, seed=3)
    loss = model(x, y, document_ids=ids)[1]
    loss.backward()
    masked = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    total, count = 0.0, 0
    for b in range(2):
        for d in ids[b].unique():
            where = (ids[b] == d).nonzero().flatten()
            logits = model(x[b:b + 1, where])[0][0]
            total = total + torch.nn.functional.cross_entropy(logits, y[b, where],
                                                              reduction="sum")
            count += len(where)
    (total / count).backward()
    torch.testing.assert_close(loss, total / count, rtol=1e-5, atol=1e-6)
    for name, grad in masked.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_chunked_kda_restarts_the_state_where_a_chunk_says_so():
    g = torch.Generator().manual_seed(0)
    b, t, h, k = 2, 48, 2, 8
    q = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=g), dim=-1)
    kk = torch.nn.functional.normalize(torch.randn(b, t, h, k, generator=g), dim=-1)
    v, beta = torch.randn(b, t, h, k, generator=g), torch.rand(b, t, h, generator=g)
    gate = -torch.rand(b, t, h, k, generator=g)
    restart = torch.tensor([[False, True, False], [False, False, True]])
    o, _ = chunk_kda(q, kk, v, gate, beta, chunk_size=16, restart=restart)
    for row, cut in ((0, 16), (1, 32)):
        parts = [recurrent_kda(*(z[row:row + 1, span] for z in (q, kk, v, gate, beta)))[0]
                 for span in (slice(0, cut), slice(cut, t))]
        torch.testing.assert_close(o[row:row + 1], torch.cat(parts, dim=1), rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ValueError, match=r"restart must be \[B, chunks\]"):
        chunk_kda(q, kk, v, gate, beta, chunk_size=16, restart=restart[:, :2])


def test_qk_clip_observes_only_pairs_inside_a_document():
    from k3_qkclip import head_max_logits

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 2, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g)
    mask = Documents.from_ids(_ids(), (2, T)).mask
    expected = torch.stack([
        torch.stack([(q[b, h] @ k[b, h].T * 8**-0.5).masked_fill(~mask[b, 0], -torch.inf)
                     .max() for b in range(2)]).max() for h in range(2)])
    torch.testing.assert_close(head_max_logits(q, k, mask=mask), expected)
    assert (head_max_logits(q, k) >= expected).all()


def test_positions_count_from_each_document_start():
    docs = Documents.from_ids(torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3]]), (1, 8))
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    assert docs.starts.tolist() == [[True, False, True, False, False, True, True, False]]


@pytest.mark.parametrize("ids, message", [
    (torch.zeros(2, T - 1, dtype=torch.long), "must have the tokens' shape"),
    (torch.zeros(2, T), "must be integers"),
    (torch.tensor([[0] * 10 + [1] * 10 + [0] * 12] * 2), "non-decreasing along each row"),
])
def test_bad_document_ids_are_refused(ids, message):
    model = small_model("hybrid", max_seq_len=T)
    with pytest.raises(ValueError, match=message):
        model(tokens(2, T), document_ids=ids)
