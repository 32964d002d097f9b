"""k3-train plan's figures against what a real step allocates (one process here; FSDP2
and EP2 in the workspace's tests/test_planning_ranks.py), and the layout refusals."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from k3_model import K3Model, count_parameters, flops_per_token
from k3_model.moe import Experts
from k3_model.presets import preset
from k3_trainer.cli import main
from k3_trainer.config import TrainConfig
from k3_trainer.optim import build_optimizer
from k3_trainer.planning import (
    LayoutError,
    Options,
    ParallelLayout,
    gpu,
    inventory,
    make_plan,
    stage_blocks,
    validate_layout,
)
from k3_trainer.planning.measure import saved_activation_bytes, state_nbytes


def _step(model, normuon=False):
    optimizer = build_optimizer(model, TrainConfig(muon_normuon=normuon))
    x = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator()
                      .manual_seed(0))
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("normuon", [False, True])
def test_one_process_state_bytes_equal_a_real_step_to_the_byte(normuon):
    config = preset("tiny")
    torch.manual_seed(0)
    model = K3Model(config)
    real = state_nbytes(model, _step(model, normuon))
    plan = make_plan(inventory(config), ParallelLayout(seq_len=16), gpu("h100"),
                     Options(precision="fp32", normuon=normuon))
    (stage,) = plan.stages
    assert (stage.params_bytes, stage.grads_bytes, stage.optimizer_bytes) == (
        real["params"], real["grads"], real["optimizer"])


def _measured(config, batch, seq, bf16, checkpointing):
    torch.manual_seed(0)
    model = K3Model(config)
    model.set_activation_checkpointing("block" if checkpointing else "none")
    x = torch.randint(0, config.vocab_size, (batch, seq + 1))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model(x[:, :-1], x[:, 1:])[1]

    return saved_activation_bytes(model, forward)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("overrides", [{}, dict(kda_head_dim=16, d_ff=256, moe_d_ff=96,
                                                moe_latent_dim=48, n_heads=8, v_head_dim=16,
                                                kv_lora_rank=32, qk_nope_head_dim=16)])
def test_activations_within_ten_percent_of_what_autograd_saves(checkpointing, bf16, overrides):
    config = preset("tiny", **overrides)
    batch, seq = 4, 128
    measured = _measured(config, batch, seq, bf16, checkpointing)
    plan = make_plan(inventory(config), ParallelLayout(batch_size=batch, seq_len=seq),
                     gpu("h100"), Options(precision="bf16" if bf16 else "fp32",
                                          checkpointing=checkpointing, scores=True))
    assert plan.stages[0].activations_bytes == pytest.approx(measured, rel=0.10)


def _counted_flops(config, batch, seq):
    """FlopCounterMode's counts by operator over a real forward and backward. The routed
    experts run their per-expert loop (``F.linear``): the counter has no formula for
    ``grouped_mm`` (torch 2.13) and would miss them; the FLOPs are the same."""
    torch.manual_seed(0)
    model = K3Model(config)
    for module in model.modules():
        if isinstance(module, Experts):
            module.use_grouped_mm = False
    x = torch.randint(0, config.vocab_size, (batch, seq + 1))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("overrides", [{}, dict(kda_output_gate_rank=16, q_lora_rank=32,
                                                n_shared_experts=2, moe_top_k=3)])
def test_flops_within_two_percent_of_torch_flop_counter(overrides):
    """The weight matmuls (``6·N_matmul`` per token) equal the counter's ``mm`` plus three
    times its forward depthwise convolutions (forward, input and weight gradients) to
    the FLOP. The counter's ``convolution_backward`` is not used: torch 2.13's formula
    ignores ``groups`` and counts a depthwise convolution's weight gradient as a dense
    one (channels times too many). With the activation products (MLA's scores and
    values, KDA's chunk terms: ``bmm``/``baddbmm``) the whole is within 2%."""
    config = preset("tiny", kda_backend="torch", **overrides)
    batch, seq = 2, 128
    ops = _counted_flops(config, batch, seq)
    tokens = batch * seq
    conv = ops.get("aten.convolution", 0)
    assert 6 * count_parameters(config).matmul * tokens == ops["aten.mm"] + 3 * conv
    counted = sum(ops.values()) - ops.get("aten.convolution_backward", 0) + 2 * conv
    plan = make_plan(inventory(config), ParallelLayout(batch_size=batch, seq_len=seq),
                     gpu("h100"))
    assert plan.flops_per_step == flops_per_token(config, seq) * tokens
    assert plan.flops_per_step == pytest.approx(counted, rel=0.02)


def test_pipeline_stages_split_blocks_and_state_sums_to_the_whole():
    config = preset("kimi-k3")
    inv = inventory(config)
    whole = make_plan(inv, ParallelLayout(seq_len=64), gpu("h200"), Options(precision="fp32"))
    piped = make_plan(inv, ParallelLayout(pp=4, microbatches=4, batch_size=4, seq_len=64),
                      gpu("h200"), Options(precision="fp32"))
    assert list(stage_blocks(93, 4)[0]) == list(range(24))
    assert sum(s.params_bytes for s in piped.stages) == whole.stages[0].params_bytes
    with torch.device("meta"):
        model = K3Model(config)
    first = sum(p.numel() for n, p in model.named_parameters()
                if n.startswith("embed")
                or (n.startswith("layers.") and int(n.split(".")[1]) < 24))
    assert piped.stages[0].params_bytes == 4 * first
    # 1F1B: pipeline rank r keeps pp − r microbatches; cp splits the tokens
    assert piped.stages[0].activations_bytes > piped.stages[3].activations_bytes
    cp = make_plan(inv, ParallelLayout(cp=2, seq_len=64), gpu("h200"), Options())
    assert cp.stages[0].params_bytes * 2 == pytest.approx(whole.stages[0].params_bytes,
                                                          rel=1e-3)


@pytest.mark.parametrize("layout, kwargs, message", [
    (ParallelLayout(dp=2, pp=2, microbatches=2, batch_size=2), dict(world_size=8),
     "world size 8 is not dp·cp·pp"),
    (ParallelLayout(pp=4, microbatches=4, batch_size=4), dict(), "decoder blocks"),
    (ParallelLayout(pp=2, microbatches=1), dict(), "microbatches .1. must be ≥ pp"),
    (ParallelLayout(batch_size=3, microbatches=2, pp=2), dict(), "does not split"),
    (ParallelLayout(cp=2, seq_len=63), dict(), "not divisible by cp"),
    (ParallelLayout(dp=2, ep=4), dict(), "ep .4. must divide dp·cp"),
    (ParallelLayout(dp=3, ep=3), dict(n_experts=8), "must divide the routed experts"),
])
def test_invalid_layouts_are_refused_in_one_line(layout, kwargs, message):
    with pytest.raises(LayoutError, match=message) as caught:
        validate_layout(layout, n_blocks=3, **kwargs)
    assert "\n" not in str(caught.value)


def test_plan_json_reports_the_published_counts(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--nodes", "64", "--pp", "16", "--ep", "32",
                 "--pp-microbatches", "16", "--batch-size", "16", "--seq-len", "4096",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = preset("kimi-k3")
    with torch.device("meta"):
        numel = sum(p.numel() for p in K3Model(config).parameters())
    assert out["model"]["params"] == numel
    assert len(out["stages"]) == 16 and out["layout"]["world_size"] == 512
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                "total_bytes"):
        assert key in out["stages"][0]
    for key in ("fits", "flops_per_step", "step_time_s", "tokens_per_s"):
        assert key in out
    assert main(["plan", "--preset", "kimi-linear-48b-a3b", "--suggest", "--json",
                 "--seq-len", "4096", "--activation-checkpointing"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts and all(x["dp"] * x["pp"] * x["cp"] == 8 for x in layouts)
    assert all((x["dp"] * x["cp"]) % x["ep"] == 0 for x in layouts)
    rates = [x["tokens_per_s"] for x in layouts if x["fits"]]
    assert rates == sorted(rates, reverse=True)


def test_an_impossible_layout_is_refused_by_the_command(capsys):
    assert main(["plan", "--preset", "tiny", "--nodes", "1", "--gpus-per-node", "2",
                 "--pp", "2", "--pp-microbatches", "1"]) == 2
    assert "microbatches" in capsys.readouterr().err
