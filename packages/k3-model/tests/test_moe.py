from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from k3_model import (
    GatedMLP,
    MoE,
    QuantileBalancer,
    RoutingStats,
    expert_counts,
    quantile_bias,
    situ_glu,
)
from k3_model.moe import decoding


def test_quantile_bias_matches_a_hand_solved_example():
    # 3 tokens, 3 experts, k = 1: each expert's fair share is one token.
    s = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.6, 0.2], [0.7, 0.3, 0.4]])
    cutoff = torch.tensor([0.5, 0.6, 0.4])  # 2nd largest score (bias 0)
    # required biases r = cutoff - s per expert: e0 {-.4,-.2,-.3}, e1 {0,0,.1}, e2 {.4,.4,0};
    # midpoint of the 1st and 2nd smallest: -.35, 0, .2; minus their mean (-.05):
    bias = quantile_bias(s, cutoff, top_k=1)
    torch.testing.assert_close(bias, torch.tensor([-0.30, 0.05, 0.25]))
    assert (s + bias).argmax(dim=1).tolist() == [0, 1, 2]  # one token each


def test_balancer_solves_a_fixed_skewed_batch_to_equal_load():
    g = torch.Generator().manual_seed(0)
    t, e, k = 1000, 8, 2
    scores = torch.sigmoid(torch.randn(t, e, generator=g) + torch.linspace(2, -2, e))
    balancer = QuantileBalancer(e, k).train()
    balancer(scores)
    first = balancer.load.clone()
    for _ in range(10):
        balancer(scores)
    target = k * t / e
    assert (first - target).abs().max() > 0.5 * target  # skewed to begin with
    assert (balancer.load - target).abs().max() < 0.05 * target
    assert abs(balancer.bias.mean().item()) < 1e-6  # mean-centred


def test_selection_uses_the_bias_but_gates_use_unbiased_scores(make_config):
    torch.manual_seed(0)
    layer = MoE(make_config()).eval()
    x = torch.randn(64, 48)
    scores = layer.router(x)
    layer.balancer.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # force expert 3
    experts, gates = layer.route(x)
    assert (experts == 3).any(dim=1).all()
    picked = scores.gather(1, experts)
    torch.testing.assert_close(gates, picked / picked.sum(dim=1, keepdim=True))
    torch.testing.assert_close(gates.sum(dim=1), torch.ones(64))
    assert gates.dtype == torch.float32


def test_balancer_updates_on_training_forwards_only(make_model, make_tokens):
    model = make_model()
    balancer = model.layers[1].mlp.balancer
    before = {k: v.clone() for k, v in balancer.state_dict().items()}
    model.eval()
    with torch.no_grad():
        model(make_tokens())
    for key, value in balancer.state_dict().items():
        assert torch.equal(value, before[key]), key
    model.train()
    model(make_tokens())
    after = balancer.state_dict()
    assert after["updates"].item() == 1
    assert after["load"].sum().item() == 2 * 16 * 2  # tokens × top-k
    assert not torch.equal(after["bias"], before["bias"])


def _balancers(model):
    return [m for m in model.modules() if isinstance(m, QuantileBalancer)]


def test_balancer_gather_is_per_model_and_feeds_the_update(make_model, make_tokens):
    """``set_balancer_gather`` reaches every balancer of one model and no other's: the
    fake gather (this rank's rows twice, as if a second rank had the same tokens) doubles
    the load the update counts, while the other model still counts only its own tokens."""
    calls: list[tuple[int, ...]] = []

    def gather(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return torch.cat([t, t])

    gathered, alone = make_model(n_layers=3).train(), make_model(n_layers=3).train()
    gathered.set_balancer_gather(gather)
    assert all(b.token_gather is gather for b in _balancers(gathered))
    assert all(b.token_gather is None for b in _balancers(alone))
    assert not any("gather" in key for key in gathered.state_dict())
    gathered(make_tokens())
    alone(make_tokens())
    tokens = 2 * 16
    assert sorted(calls) == sorted([(tokens, 4), (tokens,), (tokens, 2)] * 2)  # 2 MoE layers
    for with_gather, without in zip(_balancers(gathered), _balancers(alone), strict=True):
        assert without.load.sum().item() == tokens * 2  # tokens × top-k
        assert torch.equal(with_gather.load, 2 * without.load)
    gathered.eval()
    with torch.no_grad():
        gathered(make_tokens())  # no update, so no gather
    assert len(calls) == 6
    gathered.train()
    gathered.set_balancer_gather(None)
    gathered(make_tokens())
    assert len(calls) == 6
    assert all(b.load.sum().item() == tokens * 2 for b in _balancers(gathered))


def test_balancer_gather_set_after_a_compiled_call_is_used(make_model, make_tokens):
    """The gather is read inside the traced block forward: setting it after the block was
    compiled takes effect (dynamo guards on it and retraces)."""
    model = make_model("gqa").train()
    model.layers[1].compile(backend="eager", dynamic=False)
    balancer = model.layers[1].mlp.balancer
    model(make_tokens())
    assert balancer.load.sum().item() == 64
    model.set_balancer_gather(lambda t: torch.cat([t, t]))
    model(make_tokens())
    assert balancer.load.sum().item() == 128
    model.set_balancer_gather(None)
    model(make_tokens())
    assert balancer.load.sum().item() == 64


@pytest.mark.parametrize("kind", ["k3", "mla"])
def test_each_block_compiles_to_one_graph_under_bf16_autocast(make_model, make_tokens, kind):
    """A regional compile gets one graph per decoder block, training and evaluating, where
    the grouped GEMM is traceable (bf16: torch 2.13's shape function takes bf16 only);
    ``fullgraph=True`` raises at any graph break. The decoding flag, a ContextVar dynamo
    cannot read, used to break every MoE block's graph in the experts' call."""
    torch.compiler.reset()  # other tests' compiled blocks count towards the recompile limit
    model = make_model(kind).train()
    assert model.layers[1].mlp.experts.grouped_mm_applies(torch.empty(0, dtype=torch.bfloat16))
    for layer in model.layers:
        layer.compile(fullgraph=True, backend="eager", dynamic=False)
    x = make_tokens()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, targets=x)
        loss.backward()
        with torch.no_grad():
            model.eval()(x)


def test_balancer_off_keeps_zero_bias_but_records_load(make_model, make_tokens):
    model = make_model(moe_balance=False).train()
    model(make_tokens())
    balancer = model.layers[1].mlp.balancer
    assert torch.equal(balancer.bias, torch.zeros(4))
    assert balancer.updates.item() == 1 and balancer.load.sum().item() == 64


def test_balancer_state_round_trips_through_the_state_dict(make_model, make_tokens):
    model = make_model().train()
    for seed in range(3):
        model(make_tokens(seed=seed))
    clone = make_model(seed=5)
    clone.load_state_dict(model.state_dict())
    assert torch.equal(clone.layers[1].mlp.balancer.bias, model.layers[1].mlp.balancer.bias)
    model.eval()
    clone.eval()
    torch.testing.assert_close(clone(make_tokens())[0], model(make_tokens())[0])


def _skewed_layer(make_config, balance: bool) -> MoE:
    torch.manual_seed(0)
    layer = MoE(make_config(moe_balance=balance, n_experts=8, moe_d_ff=8)).train()
    with torch.no_grad():  # feature 0 is constant 1, so its column is a per-expert skew
        layer.router.weight.normal_(0.0, 0.3)
        layer.router.weight[:, 0] = torch.linspace(3.0, -3.0, 8)
    return layer


def _load_cvs(layer: MoE, forwards: int = 50) -> list[float]:
    g = torch.Generator().manual_seed(1)
    cvs = []
    for _ in range(forwards):
        x = torch.randn(512, 48, generator=g)
        x[:, 0] = 1.0
        with torch.no_grad():
            layer(x)
        load = layer.balancer.load.double()
        cvs.append((load.std(unbiased=False) / load.mean()).item())
    return cvs


def test_balancing_evens_out_a_deliberately_skewed_router(make_config):
    off = _load_cvs(_skewed_layer(make_config, balance=False))
    on = _load_cvs(_skewed_layer(make_config, balance=True))
    assert on[0] == pytest.approx(off[0])  # same first choice: the bias starts at zero
    mean_off, mean_on = sum(off[10:]) / 40, sum(on[10:]) / 40
    assert mean_off > 0.8
    assert mean_on < 0.25 * mean_off


def test_experts_match_a_per_token_reference(make_config):
    torch.manual_seed(0)
    layer = MoE(make_config(n_shared_experts=0)).eval()
    x = torch.randn(40, 48)
    experts, gates = layer.route(x)
    w = layer.experts
    expected = torch.zeros_like(x)
    for t in range(40):
        for j in range(2):
            e = experts[t, j]
            h = F.silu(w.w_gate[e] @ x[t]) * (w.w_up[e] @ x[t])
            expected[t] += gates[t, j] * (w.w_down[e] @ h)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_routing_stats_are_collected_only_when_asked_and_in_training(make_model, make_tokens):
    model = make_model(n_layers=3).train()
    model(make_tokens())
    assert model.pop_moe_stats() == {}  # off by default
    model.set_moe_stats(True)
    for seed in range(3):
        model(make_tokens(seed=seed))
    model.eval()
    with torch.no_grad():
        model(make_tokens())  # eval forwards are not training statistics
    stats = model.pop_moe_stats()
    assert list(stats) == ["layers.1.mlp", "layers.2.mlp"]
    for name, s in stats.items():
        assert s.forwards == 3
        assert s.tokens_per_expert.sum().item() == 3 * 32 * 2
        metrics = s.to_metrics()
        bias = model.get_submodule(name).balancer.bias
        assert metrics["bias_min"] == pytest.approx(bias.min().item())
        assert metrics["bias_max"] == pytest.approx(bias.max().item())
        assert sum(metrics["load_per_step"]) == pytest.approx(32 * 2)
    assert model.pop_moe_stats() == {}  # read-and-clear
    model.set_moe_stats(False)
    model.train()
    model(make_tokens())
    assert model.pop_moe_stats() == {}


def test_routing_stats_metrics_by_hand():
    stats = RoutingStats(torch.tensor([8, 0, 4, 4]), 2, torch.tensor([-0.5, 0.25, 0.0, 0.25]))
    m = stats.to_metrics()
    assert m["load_per_step"] == [4.0, 0.0, 2.0, 2.0]
    assert m["load_cv"] == pytest.approx(2**0.5 / 2)  # std √8 / mean 4
    assert m["max_load_ratio"] == pytest.approx(2.0)
    assert m["dead_experts"] == 1
    assert (m["bias_min"], m["bias_max"], m["forwards"]) == (-0.5, 0.25, 2)


def test_balancer_rejects_invalid_arguments():
    with pytest.raises(ValueError, match="top_k"):
        QuantileBalancer(4, 4)
    with pytest.raises(ValueError, match="rate"):
        QuantileBalancer(4, 2, rate=0.0)


def test_latent_moe_matches_a_per_token_reference(make_config):
    torch.manual_seed(0)
    config = make_config(moe_latent_dim=16, activation="situ", n_shared_experts=2)
    layer = MoE(config).eval()
    assert layer.experts.w_gate.shape == (4, 32, 16)  # experts run at the latent width
    assert layer.shared is not None and layer.shared.w_gate.weight.shape == (64, 48)
    x = torch.randn(40, 48)
    experts, gates = layer.route(x)  # the router reads the full-width input
    assert layer.router.weight.shape == (4, 48)
    w = layer.experts
    latent = layer.down_proj(x)
    routed = torch.zeros(40, 16)
    for t in range(40):
        for j in range(2):
            e = experts[t, j]
            h = situ_glu(w.w_gate[e] @ latent[t], w.w_up[e] @ latent[t])
            routed[t] += gates[t, j] * (w.w_down[e] @ h)
    expected = layer.up_proj(layer.latent_norm(routed)) + layer.shared(x)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


def test_situ_glu_is_the_k3_formula_in_fp32():
    g = torch.linspace(-60, 60, 241)
    u = torch.linspace(-200, 200, 241)
    expected = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    torch.testing.assert_close(situ_glu(g, u), expected)
    assert situ_glu(g, u).abs().max() < 4 * 25  # both factors are capped
    gb, ub = g.bfloat16(), u.bfloat16()
    out = situ_glu(gb, ub)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, situ_glu(gb.float(), ub.float()).bfloat16())  # fp32 inside
    with pytest.raises(ValueError, match="activation"):
        GatedMLP(8, 16, activation="gelu")


def _grouped_and_looped(layer: MoE, x: torch.Tensor) -> list[tuple[torch.Tensor, dict]]:
    results = []
    for grouped in (True, False):
        layer.zero_grad()
        layer.experts.use_grouped_mm = grouped
        out = layer(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()
                                       if p.grad is not None}))
    return results


@pytest.mark.parametrize("latent", [0, 16])
def test_grouped_gemm_and_per_expert_loop_agree_forward_and_backward(make_config, latent):
    torch.manual_seed(0)
    layer = MoE(make_config(moe_latent_dim=latent, activation="situ")).eval()
    x = torch.randn(64, 48)
    assert layer.experts.grouped_mm_applies(x)
    (grouped, g_grads), (looped, l_grads) = _grouped_and_looped(layer, x)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    assert g_grads.keys() == l_grads.keys() and any("experts" in n for n in g_grads)
    for name in g_grads:
        torch.testing.assert_close(g_grads[name], l_grads[name], rtol=1e-5, atol=1e-6)
    # a plain .sum() hands backward an expanded gradient, which the kernel rejects raw
    layer.experts.use_grouped_mm = True
    layer(x).sum().backward()


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_a_few_tokens_without_autograd_gather_their_experts_with_the_same_result(
        make_config, activation, monkeypatch):
    """A decoding step's handful of assignments: each expert's matrices gathered and one
    batched matmul, equal to the grouped kernel's result; never outside decoding, so
    training and evaluation forwards stay bitwise what they were."""
    torch.manual_seed(0)
    layer = MoE(make_config(moe_latent_dim=16, activation=activation)).eval()
    x = torch.randn(8, 48)
    calls = []
    gathered = layer.experts._gathered
    monkeypatch.setattr(layer.experts, "_gathered", lambda *a: calls.append(1) or gathered(*a))
    with torch.no_grad(), decoding():
        few = layer(x)
        layer.experts.gather_below = 0
        grouped = layer(x)
    assert len(calls) == 1  # the first call only
    torch.testing.assert_close(few, grouped, rtol=1e-5, atol=1e-6)
    layer.experts.gather_below = 64
    with torch.no_grad():
        layer(x)  # not decoding: an evaluation forward keeps the grouped kernel
    assert len(calls) == 1


def test_the_grouped_path_is_torchs_public_grouped_mm(make_config, monkeypatch):
    """``torch.nn.functional.grouped_mm`` (public from torch 2.10), one call per expert
    weight kind; a torch without it gets the per-expert loop."""
    torch.manual_seed(0)
    layer = MoE(make_config(moe_latent_dim=16)).eval()  # eval: the balancer stays put
    x = torch.randn(64, 48)
    public = mock.Mock(wraps=F.grouped_mm)
    monkeypatch.setattr(F, "grouped_mm", public)
    grouped = layer(x)
    assert public.call_count == 3  # gate, up, down

    monkeypatch.delattr(F, "grouped_mm")
    assert not layer.experts.grouped_mm_applies(x)
    torch.testing.assert_close(layer(x), grouped, rtol=1e-5, atol=1e-6)


def test_the_grouped_path_never_syncs_and_the_fallback_is_the_documented_one(make_config):
    torch.manual_seed(0)
    layer = MoE(make_config(moe_latent_dim=16)).train()
    layer.collect_stats = True
    x = torch.randn(64, 48)

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync in the MoE forward")

    with mock.patch.object(torch.Tensor, "tolist", no_sync), \
            mock.patch.object(torch.Tensor, "item", no_sync), \
            mock.patch.object(torch.Tensor, "__bool__", no_sync):
        layer(x)
    assert layer.balancer.load.sum() == 64 * 2
    x64 = x.double()
    layer.double()
    assert not layer.experts.grouped_mm_applies(x64)  # the kernel has no fp64
    odd = MoE(make_config(moe_d_ff=30))  # 30 fp32 = 120-byte rows: not a multiple of 16
    assert not odd.experts.grouped_mm_applies(x)
    with mock.patch.object(torch.Tensor, "tolist", no_sync), pytest.raises(AssertionError):
        layer(x64)  # the per-expert loop reads the group sizes on the host


def test_expert_counts_is_bincount_without_the_sync():
    flat = torch.randint(0, 7, (500,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_counts(flat, 9), torch.bincount(flat, minlength=9))
    assert torch.equal(expert_counts(flat[:0], 3), torch.zeros(3, dtype=torch.int64))
