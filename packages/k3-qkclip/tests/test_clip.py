"""QK-Clip invariants on small MHA, GQA and MLA modules (DESIGN §3)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from k3_qkclip import QKClip, QKClipPolicy

KINDS = ("mha", "mha_fused", "gqa", "mla")


def tau_between(s: torch.Tensor) -> float:
    """A τ with at least one head above it and one below."""
    ordered = sorted(s.tolist())
    k = len(ordered) // 2
    assert ordered[k - 1] < ordered[k], "need distinct maxima to split the heads"
    return (ordered[k - 1] + ordered[k]) / 2


def expected_row_factors(kind: str, gamma: torch.Tensor, mode: str = "query_only"):
    """Row factors per parameter name by DESIGN §3, written out by hand for each layout."""
    sq = gamma.sqrt()
    f: dict[str, torch.Tensor] = {}
    if kind == "mha":
        f["q_proj"] = sq.repeat_interleave(8)
        f["k_proj"] = sq.repeat_interleave(8)
    elif kind == "mha_fused":
        f["qkv"] = torch.cat([sq.repeat_interleave(8), sq.repeat_interleave(8), torch.ones(32)])
    elif kind == "gqa" and mode == "query_only":
        f["q_proj"] = gamma.repeat_interleave(8)  # keys (shared by 2 heads) untouched
    elif kind == "gqa":  # group_min: √γ_min of each kv group on its q and k rows
        group = gamma.view(2, 2).amin(dim=1).sqrt()
        f["q_proj"] = group.repeat_interleave(16)
        f["k_proj"] = group.repeat_interleave(8)
    elif kind == "mla":  # q rows per head [nope 8 | rope 4]; kv_b rows per head [k_nope 8 | v 6]
        f["q_proj"] = torch.cat(
            [sq.view(4, 1).expand(4, 8), gamma.view(4, 1).expand(4, 4)], 1
        ).reshape(-1)
        f["kv_b_proj"] = torch.cat([sq.view(4, 1).expand(4, 8), torch.ones(4, 6)], 1).reshape(-1)
    return f


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), name


def clip_once(model, x, policy):
    with QKClip(model, policy) as clip:
        clip.reset()
        model(x).sum().backward()
        clip.validate()
        return clip.apply()


@pytest.mark.parametrize("kind", KINDS)
def test_reobserved_max_logit_is_min_of_s_and_tau(kind, make, make_batch, observe_logits):
    model, x = make(kind), make_batch()
    s = observe_logits(model, x)[""]
    tau = tau_between(s)
    report = clip_once(model, x, QKClipPolicy(tau=tau))
    after = observe_logits(model, x)[""]

    over = s > tau
    assert over.any() and (~over).any()
    target = torch.minimum(s, torch.tensor(tau))
    torch.testing.assert_close(after, target, rtol=1e-5, atol=0)
    assert torch.equal(after[~over], s[~over])  # heads below τ: bitwise the same logits
    module_report = report.modules[""]
    assert torch.equal(module_report.max_logits, s)
    assert module_report.heads_clipped == int(over.sum())
    assert module_report.min_gamma == pytest.approx(tau / float(s.max()), rel=1e-6)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_rows_scale_per_design_and_nothing_else_changes(
    kind, bias, make, make_batch, observe_logits
):
    model, x = make(kind, bias=bias), make_batch()
    s = observe_logits(model, x)[""]
    tau = tau_between(s)
    before = snapshot(model)
    clip_once(model, x, QKClipPolicy(tau=tau))
    after = snapshot(model)

    gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
    factors = expected_row_factors(kind, gamma)
    for name, old in before.items():
        target, _, leaf = name.rpartition(".")
        factor = factors.get(target)
        if factor is None or leaf not in ("weight", "bias"):
            assert torch.equal(after[name], old), f"{name} must be untouched"
            continue
        expected = old * factor.view((-1,) + (1,) * (old.dim() - 1))
        torch.testing.assert_close(after[name], expected, rtol=1e-6, atol=0)
        keep = factor == 1
        assert torch.equal(after[name][keep], old[keep]), f"{name}: unclipped rows changed"
        assert not torch.equal(after[name][~keep], old[~keep]), f"{name}: clipped rows unchanged"


def test_gqa_group_min_scales_group_by_its_smallest_gamma(make, make_batch, observe_logits):
    model, x = make("gqa"), make_batch()
    s = observe_logits(model, x)[""]
    tau = tau_between(s)
    before = snapshot(model)
    clip_once(model, x, QKClipPolicy(tau=tau, gqa="group_min"))
    after_logits = observe_logits(model, x)[""]

    gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
    group_gamma = gamma.view(2, 2).amin(dim=1).repeat_interleave(2)
    # every head of a group scales by the group's γ_min; the group's max head lands on τ
    torch.testing.assert_close(after_logits, s * group_gamma, rtol=1e-5, atol=0)
    assert float(after_logits.max()) == pytest.approx(tau, rel=1e-5)
    factors = expected_row_factors("gqa", gamma, mode="group_min")
    for target in ("q_proj", "k_proj"):
        name = f"{target}.weight"
        expected = before[name] * factors[target].view(-1, 1)
        torch.testing.assert_close(model.state_dict()[name], expected, rtol=1e-6, atol=0)
    assert (group_gamma < gamma).any(), "some head must be clipped below its own γ"


def test_gamma_rule_threshold_zero_and_negative(make):
    """γ = τ/S only for S > τ; S == τ, S ≤ 0 and unobserved (-inf) heads stay exactly."""
    model = make("mha")
    before = snapshot(model)
    with QKClip(model, QKClipPolicy(tau=100.0)) as clip:
        model.qk_observer.record(torch.tensor([250.0, 100.0, -300.0, -math.inf]))
        report = clip.apply()
    gamma = torch.tensor([0.4, 1.0, 1.0, 1.0])
    assert torch.equal(report.modules[""].gammas, gamma)
    assert report.modules[""].heads_clipped == 1
    factor = gamma.sqrt().repeat_interleave(8).view(-1, 1)
    for name in ("q_proj.weight", "k_proj.weight"):
        torch.testing.assert_close(model.state_dict()[name], before[name] * factor)
        assert torch.equal(model.state_dict()[name][8:], before[name][8:])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_validate_rejects_nonfinite_naming_module_and_head(bad, make):
    model = nn.ModuleDict({"layers": nn.ModuleList([make("mha"), make("mla")])})
    before = snapshot(model)
    with QKClip(model, QKClipPolicy(tau=1.0)) as clip:
        model.layers[0].qk_observer.record(torch.tensor([5.0, 5.0, 5.0, 5.0]))
        model.layers[1].qk_observer.record(torch.tensor([5.0, 5.0, bad, 5.0]))
        with pytest.raises(FloatingPointError, match=r"'layers\.1' head 2"):
            clip.validate()
        assert_bitwise_equal(before, snapshot(model))
        observed = clip.max_logits()
        assert torch.equal(observed["layers.0"], torch.full((4,), 5.0))  # nothing was cleared
        with pytest.raises(FloatingPointError, match=r"'layers\.1' head 2"):
            clip.apply()  # apply() validates unvalidated observations itself
        assert_bitwise_equal(before, snapshot(model))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_the_device_flag_lets_validate_skip_its_own_sync(bad, make, monkeypatch):
    """nonfinite() is the check as a device bool; validate(flag) trusts the host value and
    reads no tensor itself unless it has to name the offending heads."""
    model = make("mha")
    with QKClip(model, QKClipPolicy(tau=1.0)) as clip:
        assert clip.nonfinite() is None or not bool(clip.nonfinite())
        model.qk_observer.record(torch.tensor([5.0, 5.0, 5.0, 5.0]))
        flag = clip.nonfinite()
        assert flag is not None and flag.dtype == torch.bool and flag.ndim == 0
        assert not bool(flag)
        reads = []
        monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(t) or True)
        clip.validate(False)
        assert reads == []
        monkeypatch.undo()
        clip.apply()  # validated: apply does not validate again
        model.qk_observer.record(torch.tensor([5.0, bad, 5.0, 5.0]))
        assert bool(clip.nonfinite())
        with pytest.raises(FloatingPointError, match="head 1"):
            clip.validate(True)


def test_validate_accepts_finite_negative_and_unobserved(make):
    model = make("gqa")
    with QKClip(model) as clip:
        clip.validate()  # nothing observed yet
        model.qk_observer.record(torch.tensor([-math.inf, -1e30, 0.0, 1e30]))
        clip.validate()


def test_nan_weight_is_caught_before_the_optimizer(make, make_batch):
    model, x = make("gqa"), make_batch()
    with torch.no_grad():
        model.q_proj.weight[9, 3] = math.nan  # a row of head 1
    with QKClip(model) as clip:
        model(x)
        with pytest.raises(FloatingPointError, match="head 1") as info:
            clip.validate()
    assert "head 0" not in str(info.value)


def test_reset_makes_apply_a_noop(make, make_batch):
    model, x = make("mla"), make_batch()
    before = snapshot(model)
    with QKClip(model, QKClipPolicy(tau=1e-3)) as clip:  # every head would be clipped
        model(x)
        assert bool((clip.max_logits()[""] > 1e-3).all())
        clip.reset()  # e.g. an FP16 step that the GradScaler skipped
        report = clip.apply()
    assert_bitwise_equal(before, snapshot(model))
    assert report.modules[""].heads_clipped == 0


def test_disabled_policy_observes_but_never_rescales(make, make_batch, observe_logits):
    model, x = make("mha"), make_batch()
    s = observe_logits(model, x)[""]
    before = snapshot(model)
    with QKClip(model, QKClipPolicy(enabled=False, tau=1e-3)) as clip:
        model(x)
        report = clip.apply()
    assert_bitwise_equal(before, snapshot(model))
    assert torch.equal(report.modules[""].max_logits, s)
    assert report.to_metrics()["qk_heads_clipped"] == 0
    assert report.to_metrics()["qk_max_logit"] == pytest.approx(float(s.max()))


@pytest.mark.parametrize("kind", KINDS)
def test_eval_forwards_observe_nothing(kind, make, make_batch):
    model, x = make(kind), make_batch()
    before = snapshot(model)
    with QKClip(model, QKClipPolicy(tau=1e-3)) as clip:
        model.eval()
        model(x)
        assert bool(torch.isneginf(clip.max_logits()[""]).all())
        clip.apply()
        model.train()
        model(x)
        assert bool(torch.isfinite(clip.max_logits()[""]).all())
    assert_bitwise_equal(before, snapshot(model))


@pytest.mark.parametrize("kind", KINDS)
def test_observations_are_a_running_max_across_microbatches(kind, make, make_batch, observe_logits):
    model = make(kind)
    x1, x2 = make_batch(1), make_batch(2)
    s1, s2 = observe_logits(model, x1)[""], observe_logits(model, x2)[""]
    assert (s1 > s2).any() and (s2 > s1).any(), "each microbatch must win some head"
    with QKClip(model) as clip:
        model(x1)
        model(x2)
        assert torch.equal(clip.max_logits()[""], torch.maximum(s1, s2))
        clip.reset()
        model(x2)
        assert torch.equal(clip.max_logits()[""], s2)


def test_apply_clears_observations_and_is_idempotent(make, make_batch):
    model, x = make("mha"), make_batch()
    with QKClip(model, QKClipPolicy(tau=1.0)) as clip:
        model(x)
        first = clip.apply()
        assert first.modules[""].heads_clipped > 0
        assert bool(torch.isneginf(clip.max_logits()[""]).all())
        after_first = snapshot(model)
        second = clip.apply()
    assert second.modules[""].heads_clipped == 0
    assert_bitwise_equal(after_first, snapshot(model))


def test_rescale_is_in_place_and_keeps_optimizer_state(make, make_batch):
    model, x = make("gqa"), make_batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = dict(model.named_parameters())
    pointers = {n: p.data_ptr() for n, p in params.items()}
    with QKClip(model, QKClipPolicy(tau=1.0)) as clip:
        model(x).sum().backward()
        clip.validate()
        optimizer.step()
        state_before = {
            id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()
        }
        assert clip.apply().modules[""].heads_clipped > 0
    assert dict(model.named_parameters()) == params  # same Parameter objects
    assert {n: p.data_ptr() for n, p in params.items()} == pointers
    assert all(p.dtype == torch.float32 for p in params.values())
    for p, s in optimizer.state.items():
        assert all(torch.equal(v, state_before[id(p)][k]) for k, v in s.items())
    assert set(optimizer.state) == set(params.values())


def test_report_aggregates_modules_with_one_metrics_call(make, make_batch, observe_logits):
    model = nn.ModuleDict({"a": make("mha", seed=0), "b": make("gqa", seed=1)})
    x = make_batch()
    s = {}
    with QKClip(model, QKClipPolicy(enabled=False)) as clip:
        model["a"](x), model["b"](x)
        s = {k: v.clone() for k, v in clip.max_logits().items()}
    tau = tau_between(torch.cat(list(s.values())))
    with QKClip(model, QKClipPolicy(tau=tau)) as clip:
        assert clip.module_names == ["a", "b"]
        model["a"](x), model["b"](x)
        report = clip.apply()
    metrics = report.to_metrics(per_module=True)
    clipped = {k: int((v > tau).sum()) for k, v in s.items()}
    assert metrics["qk_heads_clipped"] == sum(clipped.values())
    assert metrics["qk_heads_clipped/a"] == clipped["a"]
    assert metrics["qk_max_logit"] == pytest.approx(max(float(v.max()) for v in s.values()))
    assert metrics["qk_min_gamma"] == pytest.approx(tau / metrics["qk_max_logit"], rel=1e-6)
    assert report.modules["b"].max_logit == pytest.approx(float(s["b"].max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_observe_and_apply_stay_on_device_without_sync(kind, make, make_batch, observe_logits):
    model, x = make(kind).cuda(), make_batch().cuda()
    s = observe_logits(model, x)[""]
    assert s.device.type == "cuda"
    tau = tau_between(s)
    with QKClip(model, QKClipPolicy(tau=tau)) as clip:
        model(x).sum().backward()  # warm-up (lazy CUDA initialisation may sync)
        clip.reset()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).sum().backward()
            model.qk_observer.unvalidated = False  # validate() is the one sync, by design
            report = clip.apply()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert report.modules[""].gammas.device.type == "cuda"
    after = observe_logits(model, x)[""]
    torch.testing.assert_close(
        after, torch.minimum(s, torch.tensor(tau, device="cuda")), rtol=1e-5, atol=0
    )
