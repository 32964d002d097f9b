"""k3-train plan's figures against what a real step allocates (one process here; FSDP2
and EP2 in the workspace's tests/test_planning_ranks.py), and the layout refusals."""

from __future__ import annotations

import json
from dataclasses import replace

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
    GPU,
    LayoutError,
    Options,
    ParallelLayout,
    gpu,
    inventory,
    make_plan,
    stage_blocks,
    suggest,
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


def _exact_gpu(nbytes):
    return GPU("test", nbytes, 1e15)


def test_suggest_searches_checkpointing_and_the_batch_split_and_says_which():
    """Without a pipeline: no checkpointing at the fewest accumulation splits that fit,
    then more splits, then block checkpointing; nothing fits: the smallest, marked."""
    inv = inventory(preset("tiny"))
    base = ParallelLayout(seq_len=256)
    exact = Options(headroom=0.0)

    def peak(batch, accum, checkpointing):
        layout = replace(base, batch_size=batch, grad_accum=accum)
        return make_plan(inv, layout, _exact_gpu(10**12),
                         replace(exact, checkpointing=checkpointing)).peak_bytes

    whole, halves, singles = peak(8, 1, False), peak(4, 2, False), peak(1, 8, False)
    checkpointed = peak(1, 8, True)
    assert whole > halves > singles > checkpointed
    fewest = min(a for a in (1, 2, 4, 8) if peak(8 // a, a, True) < singles)
    for memory, accum, checkpointing, fits in [(whole, 1, False, True),
                                                (whole - 1, 2, False, True),
                                                (singles, 8, False, True),
                                                (singles - 1, fewest, True, True),
                                                (checkpointed - 1, 8, True, False)]:
        (best,) = suggest(inv, 1, 8, base, _exact_gpu(memory), exact)
        assert (best.layout.grad_accum, best.layout.batch_size) == (accum, 8 // accum)
        assert (best.options.checkpointing, best.fits) == (checkpointing, fits)
        assert best.layout.global_tokens == 8 * 256


def test_suggest_keeps_the_fastest_microbatch_count_and_sharding_with_a_pipeline():
    inv = inventory(preset("tiny"))
    plans = suggest(inv, 2, 8, ParallelLayout(seq_len=64), gpu("h100"), limit=100)
    piped = [p for p in plans if p.layout.pp == 2]
    assert piped and all(p.layout.batch_size == 8 for p in piped)
    for best in piped:
        for micro in (2, 4, 8):
            for sharding in ("fsdp", "zero1"):
                other = make_plan(inv, replace(best.layout, microbatches=micro), gpu("h100"),
                                  replace(best.options, sharding=sharding))
                assert other.tokens_per_s <= best.tokens_per_s
    assert {p.layout.stages_per_rank for p in piped} == {1, 2}
    assert all(p.layout.cp == 1 for p in plans)  # context parallelism only when asked
    assert any(p.layout.cp == 2 for p in suggest(inv, 2, 8, ParallelLayout(seq_len=64),
                                                 gpu("h100"), limit=100, max_cp=2))


def test_communication_bytes_follow_the_documented_formulas():
    config = preset("tiny")
    inv = inventory(config)
    fsdp = make_plan(inv, ParallelLayout(dp=2, seq_len=64), gpu("h100"),
                     Options(precision="fp32"))
    # all-gather forward and backward (fp32) + reduce-scatter (fp32), half of it leaving
    assert fsdp.extra["comm_overlapped_bytes"] == inv.total * (2 * 4 + 4) / 2
    assert fsdp.extra["comm_exposed_bytes"] == 0
    ep = make_plan(inv, ParallelLayout(dp=2, ep=2, batch_size=2, seq_len=64), gpu("h100"),
                   Options(precision="fp32"))
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.n_layers))
    assert ep.extra["comm_exposed_bytes"] == (
        moe_layers * 4 * 2 * 64 * config.moe_top_k * config.moe_width * 2 / 2)
    experts = sum(p.numel for p in inv.parameters if p.expert)
    assert ep.extra["comm_overlapped_bytes"] == (inv.total - experts) * 12 / 2  # 1 replica
    slow = make_plan(inv, ParallelLayout(dp=2, ep=2, batch_size=2, seq_len=64), gpu("h100"),
                     Options(precision="fp32", network_gbps=0.001))
    assert slow.step_time_s > ep.step_time_s


def test_the_memory_line_names_the_budget_and_the_checkpointing(capsys):
    assert main(["plan", "--preset", "tiny", "--nodes", "1", "--gpus-per-node", "1",
                 "--gpu", "h200", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "against a budget of 118.2 GiB (H200 SXM 141GB: 131.3 GiB less 10% headroom)" \
        in out
    assert "fsdp, activation checkpointing none: fits" in out


@pytest.mark.slow
def test_kimi_k3_on_512_h200_has_layouts_that_fit(capsys):
    assert main(["plan", "--preset", "kimi-k3", "--nodes", "64", "--gpus-per-node", "8",
                 "--gpu", "h200", "--suggest", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert layouts[0]["fits"] and layouts[0]["peak_bytes"] <= layouts[0]["budget_bytes"]
    assert all(x["dp"] * x["pp"] * x["cp"] == 512 for x in layouts)
    # at 2.78 T parameters nothing fits without recomputation; each says what it chose
    assert all(x["activation_checkpointing"] is True for x in layouts if x["fits"])
    assert {x["sharding"] for x in layouts} <= {"fsdp", "zero1"}
    assert len({x["tokens_per_step"] for x in layouts}) == 1


def test_train_says_the_plans_memory_line_for_its_own_layout(tmp_path, data_dir, capsys):
    from trainer_helpers import cli_run, small_toml

    from k3_model import K3Config
    from k3_trainer.planning.launch import gib, memory_line

    run = cli_run(tmp_path, data_dir, small_toml(train=dict(
        batch_size=2, seq_len=16, activation_checkpointing="block")), 1)
    lines = [x for x in capsys.readouterr().err.splitlines() if "plan: params" in x]
    record = json.loads((run / "run.json").read_text())
    config = K3Config.from_dict(record["model_config"])
    train = TrainConfig(batch_size=2, seq_len=16, activation_checkpointing="block")
    expected = memory_line(config, train, world_size=1, mode="none")
    assert lines == [f"k3-train: {expected}"]
    (stage,) = make_plan(inventory(config), ParallelLayout(batch_size=2, seq_len=16),
                         gpu("h100"), Options(precision="fp32", checkpointing=True)).stages
    assert f"= {gib(stage.total_bytes)} per rank" in expected and "MiB" in expected


def test_interleaving_keeps_megatrons_extra_warm_up_activations():
    inv = inventory(preset("kimi-k3"))
    base = ParallelLayout(pp=4, microbatches=8, batch_size=8, seq_len=64)
    plain = make_plan(inv, base, gpu("h200"))
    interleaved = make_plan(inv, replace(base, stages_per_rank=2), gpu("h200"))
    held = [sum(s.activations_bytes for s in p.stages if s.pp_rank == 0)
            for p in (plain, interleaved)]
    assert held[1] == pytest.approx(held[0] * (1 + 3 / 8), rel=0.02)  # blocks split unevenly


def test_the_memory_line_plans_the_run_s_own_stages_and_slices():
    """Under pipeline stages it is the most loaded stage's rank; context parallelism
    splits the activations; DDP holds the whole model on every rank."""
    from k3_trainer.planning.launch import gib, memory_line

    config = preset("tiny")
    whole = TrainConfig(batch_size=4, seq_len=64, precision="fp32")
    piped = TrainConfig(batch_size=4, seq_len=64, precision="fp32", pipeline_parallel=2)
    sliced = TrainConfig(batch_size=4, seq_len=64, precision="fp32", context_parallel=2)
    options = Options(precision="fp32", headroom=0.0)
    stages = make_plan(inventory(config), ParallelLayout(pp=2, microbatches=2, batch_size=4,
                                                         seq_len=64), gpu("h100"),
                       options).stages
    heaviest = max(stages, key=lambda s: s.total_bytes)
    line = memory_line(config, piped, world_size=2, mode="fsdp")
    assert f"= {gib(heaviest.total_bytes)} per rank (the most loaded of 2 stages)" in line
    (cp,) = make_plan(inventory(config), ParallelLayout(cp=2, batch_size=4, seq_len=64),
                      gpu("h100"), options).stages
    assert f"= {gib(cp.total_bytes)} per rank" in memory_line(config, sliced, world_size=2,
                                                              mode="fsdp")
    (one,) = make_plan(inventory(config), ParallelLayout(batch_size=4, seq_len=64),
                       gpu("h100"), options).stages
    assert f"= {gib(one.total_bytes)} per rank" in memory_line(config, whole, world_size=2,
                                                               mode="ddp")
    assert cp.activations_bytes < one.activations_bytes
