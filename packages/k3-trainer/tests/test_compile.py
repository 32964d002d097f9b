"""``compile=True``: regional torch.compile of each decoder block, checked against eager.

Compiling on a 2-core CPU takes a while, so this file runs one compiled session and
compares it with an eager one, step by step, with QK-Clip clipping, the balancer moving
and the FP16 skip harness active (the pieces that touch state outside the graph).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from trainer_helpers import build_parts, train_config

from k3_model import preset
from k3_trainer import ConfigError, FP16SkipHarness, MetricsLog, Trainer
from k3_trainer.compiling import compiled_regions, prepare_model

# Two layers (KDA + dense MLP, Gated MLA + LatentMoE): every kind of block, compiled once.
TINY = preset("tiny", n_layers=2, max_seq_len=64)


def _session(data_dir, *, compile: bool):
    config = train_config(max_steps=5, log_interval=1, eval_interval=5, checkpoint_interval=5,
                          seq_len=32, compile=compile, qk_clip_tau=0.05)
    model, opt, tl, vl = build_parts(config, data_dir, TINY)
    log = MetricsLog(None)
    state = Trainer(model, opt, (tl, vl), config, callbacks=[log],
                    grad_scaler=FP16SkipHarness(init_scale=2.0**10)).fit()
    return model, state, log


# One pytest-xdist worker runs this module, so its compiled model is built once.
pytestmark = pytest.mark.xdist_group("compile")


@pytest.fixture(scope="module")
def sessions(data_dir):
    torch._dynamo.reset()
    return _session(data_dir, compile=False), _session(data_dir, compile=True)


def test_compiled_losses_follow_eager(sessions):
    (_, eager_state, eager_log), (model, state, log) = sessions
    losses = [[e["loss"] for e in run.events if e["event"] == "train"]
              for run in (eager_log, log)]
    assert len(losses[0]) == len(losses[1]) == 5
    for eager, compiled in zip(*losses):
        assert compiled == pytest.approx(eager, rel=1e-3)
    clipped = [e["qk_heads_clipped"] for e in log.events if e["event"] == "train"]
    assert sum(clipped) > 0  # QK-Clip observed through the compiled blocks
    assert state.tokens_seen == eager_state.tokens_seen
    regions = compiled_regions(model)
    assert len(regions) == TINY.n_layers
    assert all(getattr(r, "_compiled_call_impl", None) is not None for r in regions)


def test_compile_time_is_reported(sessions):
    (_, _, eager_log), (_, _, log) = sessions
    end = next(e for e in log.events if e["event"] == "session_end")
    start = next(e for e in log.events if e["event"] == "session_start")
    assert start["compile"] is True and end["compile_s"] > 0
    eager_end = next(e for e in eager_log.events if e["event"] == "session_end")
    assert eager_end["compile_s"] == 0


@pytest.mark.parametrize("dynamo_hook", [
    pytest.param(None, id="module-gone"),
    pytest.param(types.SimpleNamespace(), id="handler-gone"),
    pytest.param(types.SimpleNamespace(callback_handler=object()), id="methods-gone"),
])
def test_a_torch_without_dynamos_compile_callbacks_still_trains(data_dir, monkeypatch,
                                                                dynamo_hook):
    """The compile clock hangs on ``torch._dynamo.callback``, which is not public API: a
    torch that moves it leaves compile time unknown (``None``) and the run unharmed."""
    monkeypatch.setitem(sys.modules, "torch._dynamo.callback", dynamo_hook)
    config = train_config(max_steps=2, log_interval=1, eval_interval=2, checkpoint_interval=2,
                          seq_len=32)
    model, opt, tl, vl = build_parts(config, data_dir, TINY)
    log = MetricsLog(None)
    state = Trainer(model, opt, (tl, vl), config, callbacks=[log]).fit()

    assert state.step == 2
    end = next(e for e in log.events if e["event"] == "session_end")
    assert end["compile_s"] is None


def test_activation_checkpointing_needs_a_model_that_offers_it():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="set_activation_checkpointing"):
        prepare_model(model, train_config(activation_checkpointing="block"))
    prepare_model(model, train_config())  # "none" needs nothing
