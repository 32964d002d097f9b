"""Builders and fingerprints shared by the trainer tests."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from k3_checkpoint import capture_rng
from k3_model import K3Config, K3Model
from k3_trainer import TokenDataLoader, TrainConfig, Trainer, build_optimizer

# Small enough for many short runs on 2 CPU cores, but with every mechanism: MLA
# attention observed by QK-Clip, a dense layer and a quantile-balanced MoE layer.
MLA_MOE_MODEL = K3Config(
    vocab_size=256, d_model=32, n_layers=2, n_heads=2, max_seq_len=64, attention="mla",
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    mlp="moe", d_ff=64, n_dense_layers=1, n_experts=4, moe_top_k=2, moe_d_ff=32,
)

# A whole short run: six steps, logged every second step, evaluated and checkpointed at 3.
SHORT_RUN_TRAIN = dict(batch_size=4, seq_len=16, max_steps=6, log_interval=2, eval_interval=3,
                   checkpoint_interval=3, eval_batches=2, peak_lr=3e-3)


# MLA_MOE_MODEL's shape for `k3-train` runs driven by a --config file.
MLA_MOE_MODEL_TOML = dict(d_model=32, n_layers=2, n_heads=2, kv_lora_rank=16, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_experts=4, moe_d_ff=32, d_ff=64)


def small_toml(*, model: dict | None = None, train: dict | None = None) -> str:
    """A ``--config`` file: the tiny preset narrowed to MLA_MOE_MODEL_TOML, plus tables."""
    def table(values: dict) -> str:
        return "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in values.items())

    return ('preset = "tiny"\n[model]\n' + table({**MLA_MOE_MODEL_TOML, **(model or {})})
            + "[train]\n" + table(train or {}))


def cli_run(root, data_dir, toml_text: str, steps: int):
    """``k3-train train`` of ``steps`` steps into ``root/run`` with the ``--config`` file
    ``toml_text``; the run's folder."""
    from k3_trainer.cli import main

    (root / "c.toml").write_text(toml_text)
    assert main(["train", "--run-dir", str(root / "run"), "--data", str(data_dir), "--config",
                 str(root / "c.toml"), "--max-steps", str(steps)]) == 0
    return root / "run"


def latest_checkpoint(run_dir) -> Path:
    """The run directory's latest checkpoint file, ``checkpoints/latest/k3.ckpt`` (``latest``
    a symlink naming a ``step-NNNNNNNN`` folder beside it)."""
    link = Path(run_dir) / "checkpoints" / "latest"
    assert link.is_symlink(), f"{link} is not the symlink of a checkpoint history"
    assert os.readlink(link).startswith("step-"), os.readlink(link)
    return link / "k3.ckpt"


def train_config(**overrides) -> TrainConfig:
    return TrainConfig(**{**SHORT_RUN_TRAIN, **overrides})


def build_parts(config: TrainConfig, data_dir, model_config: K3Config = MLA_MOE_MODEL,
                seed=None):
    """Seed, then model, optimizer and both loaders, as the CLI builds them."""
    seed = config.seed if seed is None else seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = K3Model(model_config)
    optimizer = build_optimizer(model, config)
    train_loader = TokenDataLoader(data_dir, "train", config.batch_size, config.seq_len)
    val_loader = TokenDataLoader(data_dir, "val", config.batch_size, config.seq_len)
    return model, optimizer, train_loader, val_loader


def fit(model: nn.Module, optimizer, loaders, config: TrainConfig, **trainer) -> Trainer:
    """A ``Trainer`` over these parts (keyword arguments: the Trainer's), trained."""
    run = Trainer(model, optimizer, loaders, config, **trainer)
    run.fit()
    return run


def resume(path, model: nn.Module, optimizer, loaders, config: TrainConfig,
           **options) -> Trainer:
    """A ``Trainer`` over these parts, restored from the checkpoint at ``path``."""
    run = Trainer(model, optimizer, loaders, config)
    run.resume(path, **options)
    return run


def tree_digest(value: Any) -> str:
    """sha256 over a nested structure of tensors and plain values (the same hash as
    ``tree_digest`` in tests/harness.py and the k3-checkpoint tests' ckpt_helpers.py)."""
    hasher = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            hasher.update(f"T{item.dtype}{list(item.shape)}".encode())
            flat = item.detach().cpu().contiguous().reshape(-1)
            hasher.update((flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
                          .numpy().tobytes())
        elif isinstance(item, Mapping):
            for key in sorted(item, key=str):
                hasher.update(f"K{key!r}".encode())
                feed(item[key])
        elif isinstance(item, (list, tuple)):
            hasher.update(f"L{len(item)}".encode())
            for element in item:
                feed(element)
        else:
            hasher.update(f"V{item!r}".encode())

    feed(value)
    return hasher.hexdigest()


def state_fingerprint(model: nn.Module, optimizer, loaders) -> dict[str, str]:
    """Hashes of what a refused load must leave alone: weights and buffers, optimizer
    state, loader cursors, and every global RNG (as ``state_fingerprint`` in
    tests/harness.py)."""
    return {
        "model": tree_digest(model.state_dict()),
        "optimizer": tree_digest(optimizer.state_dict()),
        "loaders": tree_digest([loader.state_dict() for loader in loaders]),
        "rng": tree_digest(capture_rng()),
    }


def assert_same_state(a_model, a_opt, b_model, b_opt) -> None:
    for (name, x), y in zip(a_model.state_dict().items(), b_model.state_dict().values()):
        assert torch.equal(x, y), name
    sa, sb = a_opt.state_dict(), b_opt.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key in sa["state"]:
        for field, value in sa["state"][key].items():
            assert torch.equal(value, sb["state"][key][field]), (key, field)


class InjectAt(nn.Module):
    """Wraps a model; on chosen training calls makes the gradient overflow (``"inf"``) or
    the loss non-finite (``"nan_loss"``), for the FP16-skip and failure paths on CPU."""

    def __init__(self, inner: nn.Module, calls: set[int], kind: str = "inf") -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.calls, self.kind, self.count = calls, kind, 0

    def forward(self, x, targets=None):
        logits, loss = self.inner(x, targets=targets)
        if self.training:
            self.count += 1
            if self.count in self.calls:
                if self.kind == "nan_loss":
                    loss = loss * float("nan")
                else:
                    loss.register_hook(lambda g: g * float("inf"))
        return logits, loss
