"""NorMuon and cautious weight decay against plain float64 references, their state in
the one state dict, and the properties that define them."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from optim_reference import muon_reference_step, normuon_reference

from k3_optim import MuonAdamW
from k3_optim.normuon import RowBlocks, normuon_normalize

# name: (shape, reference layout kwargs, group options)
LAYOUT = {
    "wide": ((12, 20), {}, {}),
    "tall": ((20, 12), {}, {}),  # rows are still the 20 output neurons
    "experts": ((3, 6, 10), {"batch": True}, {}),  # per expert's own rows
    "q": ((24, 16), {"num_heads": 4}, {"num_heads": 4}),  # per head's own rows
    "conv": ((8, 3, 2, 2), {"flatten": True}, {"flatten": True}),
}
HP = dict(lr=0.03, weight_decay=0.1, momentum=0.9, nesterov=True)


def _groups(params, **options):
    return [{"params": [params[n]], "param_names": [n], "use_muon": True, **LAYOUT[n][2],
             **options} for n in LAYOUT]


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("update_scale", ["match_rms_adamw", "spectral"])
def test_normuon_step_equals_the_row_by_row_reference(update_scale, cautious):
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_()
              for n, (s, _, _) in LAYOUT.items()}
    opt = MuonAdamW(_groups(params), ns_dtype="fp64", normuon=True, normuon_beta2=0.9,
                    normuon_eps=1e-8, update_scale=update_scale,
                    cautious_weight_decay=cautious, **HP)
    refs = {n: p.detach().clone() for n, p in params.items()}
    bufs = {n: torch.zeros_like(r) for n, r in refs.items()}
    vs = {n: torch.zeros(s[:1] if "flatten" in k else s[:-1], dtype=torch.float64)
          for n, (s, k, _) in LAYOUT.items()}
    for _ in range(4):
        grads = {n: torch.randn(p.shape, dtype=torch.float64, generator=gen)
                 for n, p in params.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        for n, (_, layout, _) in LAYOUT.items():
            refs[n], bufs[n], vs[n] = muon_reference_step(
                refs[n], grads[n], bufs[n], lr=HP["lr"], wd=HP["weight_decay"],
                momentum=HP["momentum"], nesterov=True, scale_rule=update_scale,
                normuon={"v": vs[n], "beta2": 0.9, "eps": 1e-8}, cautious=cautious, **layout)
    for n, p in params.items():
        torch.testing.assert_close(p.detach(), refs[n], rtol=1e-10, atol=1e-12, msg=n)
        torch.testing.assert_close(opt.state[p]["row_second_moment"], vs[n], rtol=1e-12,
                                   atol=1e-15, msg=n)


def test_normuon_keeps_each_matrix_at_muons_size_and_equalizes_its_rows():
    """β₂ = 0: every row of a matrix is divided by its own RMS, so all rows of a block end
    with one RMS, and the block's norm is that of the orthogonalized update."""
    gen = torch.Generator().manual_seed(0)
    O = torch.randn(24, 16, dtype=torch.float64, generator=gen)
    O[:6] *= 10.0  # one block whose rows are all larger, one row larger inside another
    O[9] *= 5.0
    out = normuon_normalize([O.clone()], [torch.zeros(24, dtype=torch.float64)],
                            [RowBlocks(0, 6, 4)], beta2=0.0, eps=0.0, flatten=False)[0]
    blocks, before = out.reshape(4, 6, 16), O.reshape(4, 6, 16)
    torch.testing.assert_close(blocks.norm(dim=(1, 2)), before.norm(dim=(1, 2)))
    rms = blocks.square().mean(dim=2).sqrt()
    torch.testing.assert_close(rms, rms[:, :1].expand_as(rms))
    assert not torch.allclose(before.square().mean(dim=2).sqrt()[2], rms[2])  # it did change


def test_a_zero_update_stays_zero_and_finite():
    out = normuon_normalize([torch.zeros(4, 8)], [torch.zeros(4)], [RowBlocks(0, 4, 1)],
                            beta2=0.95, eps=1e-8, flatten=False)[0]
    assert torch.equal(out, torch.zeros(4, 8))


def test_rows_split_over_pieces_with_summed_statistics_equal_the_whole():
    """What FSDP2 does: two pieces of one per-head parameter (the cut inside a head), each
    normalized on its own rows, the per-matrix sums added across the pieces."""
    gen = torch.Generator().manual_seed(1)
    O = torch.randn(12, 8, dtype=torch.float64, generator=gen)
    whole = normuon_normalize([O.clone()], [torch.zeros(12, dtype=torch.float64)],
                              [RowBlocks(0, 4, 3)], beta2=0.5, eps=1e-8, flatten=False)[0]
    pieces, state = [O[:7].clone(), O[7:].clone()], [torch.zeros(7, dtype=torch.float64),
                                     torch.zeros(5, dtype=torch.float64)]
    shared: list[torch.Tensor] = []

    def all_reduce(flat):  # two "ranks" in one process: rendezvous, sum, hand back
        shared.append(flat)
        if len(shared) == 2:
            total = shared[0] + shared[1]
            for t in shared:
                t.copy_(total)

    import threading

    results: dict[int, torch.Tensor] = {}
    barrier = threading.Barrier(2)

    def rank(r: int, first: int) -> None:
        def reduce(flat):
            all_reduce(flat)
            barrier.wait()

        results[r] = normuon_normalize([pieces[r]], [state[r]],
                                       [RowBlocks(first, 4, 3, sharded=True)], beta2=0.5,
                                       eps=1e-8, flatten=False, all_reduce=reduce)[0]

    threads = [threading.Thread(target=rank, args=(r, f)) for r, f in ((0, 0), (1, 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([results[0], results[1]]), whole, rtol=1e-14,
                               atol=1e-15)


def _adamw_pair(cautious: bool, weight_decay: float = 0.2):
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(40, dtype=torch.float64, generator=gen).requires_grad_()
    opt = MuonAdamW([{"params": [p], "use_muon": False}], lr=0.05, weight_decay=weight_decay,
                    betas=(0.8, 0.9), cautious_weight_decay=cautious)
    return p, opt, gen


def test_cautious_decay_in_the_adamw_half_is_exactly_the_sign_mask():
    """Decay where sign(Adam's update) = sign(p), i.e. where the new first moment agrees
    with p; elsewhere exactly torch's AdamW step without decay."""
    p, opt, gen = _adamw_pair(cautious=True)
    ref = p.detach().clone().requires_grad_()
    plain = torch.optim.AdamW([ref], lr=0.05, weight_decay=0.0, betas=(0.8, 0.9))
    masks = []
    for _ in range(3):
        g = torch.randn(p.shape, dtype=torch.float64, generator=gen)
        first = (plain.state[ref]["exp_avg"] if plain.state else torch.zeros_like(g)).lerp(g, 0.2)
        mask = (torch.sign(first) == torch.sign(ref.detach())) & (ref.detach() != 0)
        masks.append(mask)
        with torch.no_grad():
            ref.sub_(ref * mask * (0.05 * 0.2))  # (bool·float is fp32: p first)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
        assert torch.equal(p.detach(), ref.detach())
    assert any(m.any() and not m.all() for m in masks)  # both kinds of coordinate occurred


def test_cautious_decay_in_the_muon_half_is_exactly_the_sign_mask():
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(8, 16, dtype=torch.float64, generator=gen).requires_grad_()
    q = p.detach().clone().requires_grad_()
    cautious = MuonAdamW([{"params": [p], "use_muon": True}], ns_dtype="fp64", lr=0.05,
                         weight_decay=0.3, cautious_weight_decay=True)
    none = MuonAdamW([{"params": [q], "use_muon": True}], ns_dtype="fp64", lr=0.05,
                     weight_decay=0.0)
    before = p.detach().clone()
    p.grad = torch.randn(p.shape, dtype=torch.float64, generator=gen)
    q.grad = p.grad.clone()
    cautious.step()
    none.step()
    update = before - q.detach()  # lr·scale·O: the undecayed step
    mask = torch.sign(update) == torch.sign(before)
    assert mask.any() and not mask.all()
    torch.testing.assert_close(p.detach(), q.detach() - before * mask * (0.05 * 0.3),
                               rtol=0, atol=1e-15)


def test_cautious_decay_without_weight_decay_changes_nothing():
    p, opt, gen = _adamw_pair(cautious=True, weight_decay=0.0)
    q, plain, _ = _adamw_pair(cautious=False, weight_decay=0.0)
    for _ in range(2):
        g = torch.randn(p.shape, dtype=torch.float64, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
    assert torch.equal(p, q)


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 48),
                               torch.nn.GELU(), torch.nn.Linear(48, 16, bias=False),
                               torch.nn.Linear(16, 50))


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 50, (4, 6), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _optimizer(model, **options):
    groups = [{"params": [model[1].weight, model[3].weight], "use_muon": True},
              {"params": [model[0].weight, model[1].bias, model[4].weight, model[4].bias],
               "use_muon": False}]
    return MuonAdamW(groups, lr=0.01, **options)


def test_normuon_state_round_trips_bitwise_through_the_one_state_dict():
    model = _tiny_model()
    opt = _optimizer(model, normuon=True, cautious_weight_decay=True)
    _train(model, opt, 3, seed=1)
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    saved_v = opt.state[model[1].weight]["row_second_moment"].clone()
    assert saved_v.shape == (48,) and saved_v.abs().sum() > 0
    _train(model, opt, 3, seed=2)

    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    resumed = _tiny_model(seed=99)
    resumed.load_state_dict(saved["model"])
    resumed_opt = _optimizer(resumed)  # constructed without the variants: the state has them
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.param_groups[0]["normuon"] and resumed_opt.param_groups[1][
        "cautious_weight_decay"]
    assert torch.equal(resumed_opt.state[resumed[1].weight]["row_second_moment"], saved_v)
    _train(resumed, resumed_opt, 3, seed=2)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_a_state_dict_from_before_the_variants_continues_as_it_ran():
    """Groups saved without ns_method/normuon/cautious keys load with the behaviour they
    had (standard Newton–Schulz, no NorMuon, plain decay)."""
    model = _tiny_model()
    opt = _optimizer(model, ns_method="standard")
    _train(model, opt, 2, seed=1)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        for key in ("ns_method", "normuon", "normuon_beta2", "normuon_eps",
                    "cautious_weight_decay"):
            del group[key]
    twin = _tiny_model(seed=9)
    twin.load_state_dict(model.state_dict())
    twin_opt = _optimizer(twin, normuon=True, ns_method="gram")
    twin_opt.load_state_dict(old)
    assert twin_opt.param_groups[0]["ns_method"] == "standard"
    assert not twin_opt.param_groups[0]["normuon"]
    _train(model, opt, 2, seed=2)
    _train(twin, twin_opt, 2, seed=2)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"normuon": 1}, "normuon must be True or False"),
        ({"normuon_beta2": 1.0}, "normuon_beta2"),
        ({"normuon_beta2": -0.1}, "normuon_beta2"),
        ({"normuon_eps": 0.0}, "normuon_eps"),
        ({"normuon_eps": float("nan")}, "normuon_eps"),
        ({"cautious_weight_decay": "yes"}, "cautious_weight_decay must be True or False"),
        ({"ns_method": "fast"}, "ns_method"),
    ],
)
def test_bad_variant_options_raise_one_clear_error(kwargs, match):
    p = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(ValueError, match=match):
        MuonAdamW([{"params": [p], "use_muon": True}], **kwargs)
    with pytest.raises(ValueError, match=match):  # the same checks per group
        MuonAdamW([{"params": [p], "use_muon": True, **kwargs}])


def test_normuon_reference_itself_normalizes_rows():
    """The reference is independent of the implementation; check it does what it says."""
    O = torch.randn(6, 5, dtype=torch.float64)
    out, v = normuon_reference(O, torch.zeros(6, dtype=torch.float64), beta2=0.0, eps=0.0,
                               rows_per_block=3)
    torch.testing.assert_close(v, O.square().mean(dim=1))
    torch.testing.assert_close(out.reshape(2, 3, 5).norm(dim=(1, 2)),
                               O.reshape(2, 3, 5).norm(dim=(1, 2)))
