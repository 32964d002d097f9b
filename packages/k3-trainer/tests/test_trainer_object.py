"""The trainer as one object: callbacks (a stateful one is one more checkpoint component),
the declared model contract, and the parameter budget of every function."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil

import pytest
import torch
from torch import nn
from trainer_helpers import build_parts, fit, state_fingerprint, train_config

import k3_trainer
from k3_checkpoint import CheckpointError, read_payload
from k3_checkpoint.payload import write_payload
from k3_trainer import Callback, ConfigError, MetricsLog, Trainer, build_optimizer


class WeightEMA(Callback):
    """A user's stateful callback: an exponential moving average of the weights."""

    name = "ema"

    def __init__(self, decay: float = 0.5) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}

    def on_step_end(self, trainer, stats) -> None:
        for name, p in trainer.model.named_parameters():
            if name not in self.shadow:
                self.shadow[name] = p.detach().clone()
            else:
                self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, object]:
        return {"decay": self.decay, "shadow": dict(self.shadow)}

    def load_state_dict(self, state, /) -> None:
        if not isinstance(state, dict) or set(state) != {"decay", "shadow"}:
            raise ValueError(f"ema state must hold decay and shadow, got {state!r:.60}")
        self.decay = state["decay"]
        self.shadow = {name: t.clone() for name, t in state["shadow"].items()}


def _same_shadow(a: WeightEMA, b: WeightEMA) -> bool:
    return a.shadow.keys() == b.shadow.keys() and all(
        torch.equal(a.shadow[n], b.shadow[n]) for n in a.shadow)


def test_a_stateful_callback_is_saved_restored_bitwise_and_rolled_back(data_dir, tmp_path):
    config = train_config(max_steps=6, decay_steps=6, checkpoint_interval=3)
    continuous = WeightEMA()
    fit(*_parts(config, data_dir), callbacks=[continuous])

    first = WeightEMA()
    fit(*_parts(config.replace(max_steps=3), data_dir), callbacks=[first],
        checkpoint_path=tmp_path / "ck.pt")
    payload = read_payload(tmp_path / "ck.pt")
    assert set(payload["callbacks"]["ema"]["shadow"]) == set(first.shadow)

    resumed = WeightEMA(decay=0.9)  # a different live state: the resume must replace it
    trainer = Trainer(*_parts(config, data_dir, seed=7), callbacks=[resumed])
    trainer.resume(tmp_path / "ck.pt")
    assert resumed.decay == 0.5 and _same_shadow(resumed, first)
    trainer.fit()
    assert _same_shadow(resumed, continuous)

    # A refusal anywhere in the checkpoint leaves the callback and everything else as it
    # was: a forged step, and the callback refusing its own state after the counters and
    # cursors were taken (they are put back).
    model, opt, (tl, vl) = trainer.model, trainer.optimizer, trainer.loaders
    before = {n: t.clone() for n, t in resumed.shadow.items()}
    prints, counters = state_fingerprint(model, opt, [tl, vl]), trainer.state.state_dict()
    for part, value, match in (("counters", {**payload["counters"], "step": -1}, "counters"),
                               ("callbacks", {"ema": {"decay": 0.5}}, "ema state must hold")):
        write_payload(tmp_path / "forged.pt", {**payload, part: value})
        with pytest.raises(CheckpointError, match=match):
            trainer.resume(tmp_path / "forged.pt")
        assert all(torch.equal(before[n], resumed.shadow[n]) for n in before)
        assert state_fingerprint(model, opt, [tl, vl]) == prints
        assert trainer.state.state_dict() == counters


def test_a_checkpoint_without_the_callbacks_state_is_refused(data_dir, tmp_path):
    config = train_config(max_steps=3, checkpoint_interval=3)
    fit(*_parts(config, data_dir), checkpoint_path=tmp_path / "ck.pt")
    ema = WeightEMA()
    trainer = Trainer(*_parts(config.replace(max_steps=6), data_dir), callbacks=[ema])
    with pytest.raises(CheckpointError, match="callbacks"):
        trainer.resume(tmp_path / "ck.pt")
    assert ema.shadow == {} and trainer.state.step == 0


def test_callbacks_see_every_event_in_order(data_dir, tmp_path):
    seen: list[tuple[str, int]] = []

    class Tracker(Callback):
        """What a user's experiment tracker would get."""

        def on_session_start(self, trainer, record):
            seen.append(("start", record["step"]))

        def on_step_end(self, trainer, stats):
            assert set(stats) == {"loss", "lr", "grad_norm", "tokens_per_s"}
            seen.append(("step", trainer.state.step))

        def on_log(self, trainer, record):
            seen.append(("log", record["step"]))

        def on_eval_end(self, trainer, record):
            assert record["val_loss"] > 0
            seen.append(("eval", record["step"]))

        def on_checkpoint_saved(self, trainer, record):
            assert (tmp_path / "ck.pt").is_file()
            seen.append(("checkpoint", record["step"]))

        def on_session_end(self, trainer, record):
            seen.append(("end", record["step"]))

    config = train_config(max_steps=3, log_interval=2, eval_interval=3, checkpoint_interval=3)
    log = MetricsLog(None)
    fit(*_parts(config, data_dir), callbacks=[log, Tracker()], checkpoint_path=tmp_path / "ck.pt")
    assert seen == [("start", 0), ("step", 1), ("step", 2), ("log", 2), ("step", 3), ("log", 3),
                    ("eval", 3), ("checkpoint", 3), ("end", 3)]
    assert [e["event"] for e in log.events] == ["session_start", "train", "train", "eval",
                                                 "checkpoint", "session_end"]


def test_two_stateful_callbacks_need_two_names(data_dir):
    config = train_config()
    with pytest.raises(ValueError, match=r"distinct names.*ema"):
        Trainer(*_parts(config, data_dir), callbacks=[WeightEMA(), WeightEMA()])
    trainer = Trainer(*_parts(config, data_dir))
    with pytest.raises(ValueError, match="must be passed to Trainer"):
        trainer.callbacks.extend([WeightEMA()])


class Foreign(nn.Module):
    """A model that knows nothing of k3-trainer: forward(x, targets) only."""

    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, x, targets=None):
        logits = self.head(torch.relu(self.hidden(self.embed(x))))
        loss = None if targets is None else nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_a_foreign_module_trains_and_checkpoints_with_the_fallbacks(data_dir, tmp_path):
    config = train_config(max_steps=4, log_interval=2, checkpoint_interval=4)
    _, _, tl, vl = build_parts(config, data_dir)
    with pytest.raises(ConfigError, match="no module of Foreign declares QK-Clip geometry"):
        Trainer(Foreign(), build_optimizer(Foreign(), config), (tl, vl), config)
    config = config.replace(qk_clip_enabled=False)  # it has no attention to clip
    torch.manual_seed(0)
    model = Foreign()
    log = MetricsLog(None)
    trainer = fit(model, build_optimizer(model, config), (tl, vl), config, callbacks=[log],
                  checkpoint_path=tmp_path / "ck.pt")
    assert trainer.state.step == 4
    window = next(e for e in log.events if e["event"] == "train")
    assert window["model_flops_per_token"] is None and window["mfu"] is None
    assert not any(key.startswith("moe_") for key in window)
    saved = read_payload(tmp_path / "ck.pt")
    assert saved["model_config"] == {"class": f"{__name__}.Foreign"}
    assert saved["vocab_size"] is None


@pytest.mark.parametrize(("model", "match"), [
    (nn.Linear(4, 4), r"Linear\.forward must accept \(x, targets=y\)"),
    ("not a module", "must be a torch.nn.Module"),
])
def test_a_model_without_the_required_forward_is_refused_by_name(data_dir, model, match):
    config = train_config(qk_clip_enabled=False)
    _, opt, tl, vl = build_parts(config, data_dir)
    with pytest.raises(ConfigError, match=match):
        Trainer(model, opt, (tl, vl), config)


def test_an_optional_piece_in_the_wrong_form_is_refused_by_name(data_dir):
    config = train_config(qk_clip_enabled=False)
    _, opt, tl, vl = build_parts(config, data_dir)
    layers = Foreign()
    layers.layers = [nn.Linear(2, 2)]  # a plain list: not blocks FSDP2/compile could use
    with pytest.raises(ConfigError, match=r"Foreign\.layers must be an nn\.ModuleList"):
        Trainer(layers, opt, (tl, vl), config)
    half = Foreign()
    half.set_moe_stats = lambda enabled: None
    with pytest.raises(ConfigError, match="only one of set_moe_stats/pop_moe_stats"):
        Trainer(half, opt, (tl, vl), config)
    no_checkpointing = Foreign()
    trainer = Trainer(no_checkpointing, opt, (tl, vl),
                      config.replace(activation_checkpointing="block"))
    with pytest.raises(ConfigError, match="has no set_activation_checkpointing"):
        trainer.fit()


# Modules that need an optional extra (their import says which); left out where it is
# missing.
OPTIONAL = {"k3_trainer.lm_eval": "lm_eval"}


def _importable_modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(k3_trainer.__path__, "k3_trainer.")
            if info.name not in OPTIONAL or importlib.util.find_spec(OPTIONAL[info.name])]


def test_no_function_of_k3_trainer_takes_more_than_eight_parameters():
    """Configs and small dataclasses carry the rest (self and cls not counted)."""
    too_many = []
    for name in _importable_modules():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            if getattr(obj, "__module__", None) != name:
                continue
            functions = [obj] if inspect.isfunction(obj) else []
            if inspect.isclass(obj) and not _is_dataclass(obj):
                functions += [f for f in vars(obj).values() if inspect.isfunction(f)]
            for function in functions:
                names = [p for p in inspect.signature(function).parameters
                         if p not in ("self", "cls")]
                if len(names) > 8:
                    too_many.append(f"{name}.{function.__qualname__} ({len(names)})")
    assert not too_many, too_many


def _is_dataclass(cls: type) -> bool:
    """A dataclass's generated __init__ takes its fields: it is the carrier, not a function."""
    import dataclasses

    return dataclasses.is_dataclass(cls)


def _parts(config, data_dir, seed=None):
    model, opt, tl, vl = build_parts(config, data_dir, seed=seed)
    return model, opt, (tl, vl), config


def test_eval_and_sample_build_no_optimizer(data_dir, tmp_path, monkeypatch, capsys):
    from trainer_helpers import small_toml

    from k3_trainer.cli import main
    from k3_trainer.session import build

    (tmp_path / "c.toml").write_text(small_toml(train=dict(
        batch_size=2, seq_len=16, eval_batches=1, warmup_steps=1, decay_steps=2)))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), "--data", str(data_dir), "--config",
                 str(tmp_path / "c.toml"), "--max-steps", "2"]) == 0

    def no_optimizer(*args, **kwargs):
        raise AssertionError("eval and sample must not build an optimizer")

    monkeypatch.setattr(build, "build_optimizer", no_optimizer)
    monkeypatch.setattr(build, "Trainer", no_optimizer)
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run)]) == 0
    assert capsys.readouterr().out.startswith("step 2: val_loss ")
    assert main(["sample", "--run-dir", str(run), "--max-new-tokens", "4", "--seed", "0"]) == 0


def test_lazy_public_names_are_never_shadowed_by_submodules():
    """The public names load on first use; a submodule of the same name would replace one
    as soon as anything imports it (``k3_trainer.evaluate`` was such a case)."""
    import k3_trainer.data

    for name in _importable_modules():
        importlib.import_module(name)
    for package in (k3_trainer, k3_trainer.data):
        for name in package.__all__:
            if name != "__version__":
                assert not inspect.ismodule(getattr(package, name)), f"{package.__name__}.{name}"
