"""A miniature training run for the checkpoint tests: model, optimizer, loaders, counters, configs.

Each training step draws from every global generator (dropout from torch, input noise from
NumPy, a batch stride from Python's ``random``), so a resume that restored any of them wrongly
would diverge.
"""

from __future__ import annotations

import hashlib
import io
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from k3_checkpoint import CompatibilityPolicy, capture_rng, read_payload
from k3_checkpoint.integrity import checksum_of_bytes
from k3_checkpoint.legacy import pack_header, sha256_blocks
from k3_checkpoint.payload import TRAILER_SIZE, pack_trailer, write_payload

VOCAB = 64
TRAINER_POLICY = CompatibilityPolicy(
    may_grow={"train_config.max_steps"}, step_limit=("train_config.max_steps", "counters.step")
)


def envelope(zip_bytes: bytes, format_version: int = 7) -> bytes:
    """``zip_bytes`` (a torch.save zip) with a correct trailer as its comment, checksum
    included: what a careful forger writes."""
    data = bytearray(zip_bytes)
    assert data[-22:-18] == b"PK\x05\x06" and data[-2:] == b"\0\0"  # the end record, last
    data[-2:] = TRAILER_SIZE.to_bytes(2, "little")  # the trailer is the zip's comment
    return bytes(data) + pack_trailer(format_version, len(data), checksum_of_bytes(data))


def write_enveloped(payload: object, path: Path, format_version: int = 7) -> bytes:
    """Write ``payload`` (a plain ``torch.save``) behind a correct trailer; returns the
    zip's bytes (everything before the trailer)."""
    body = io.BytesIO()
    torch.save(payload, body)
    enveloped = envelope(body.getvalue(), format_version)
    path.write_bytes(enveloped)
    return enveloped[:-TRAILER_SIZE]


def write_legacy(payload: object, path: Path, format_version: int = 7) -> bytes:
    """Write ``payload`` as k3-checkpoint 0.1.x did: a sha256 header, then the zip."""
    body = io.BytesIO()
    torch.save(payload, body)
    data = body.getvalue()
    path.write_bytes(pack_header(format_version, len(data), sha256_blocks(data)) + data)
    return data


def assert_same_payload(ours: Any, theirs: Any) -> None:
    """Two loads of one payload agree: the same types and values, and tensors with the same
    dtype, shape, layout, strides and storage offset."""
    assert type(ours) is type(theirs)
    if isinstance(ours, dict):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert_same_payload(ours[key], theirs[key])
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs):
            assert_same_payload(mine, other)
    elif isinstance(ours, torch.Tensor):
        assert (ours.dtype, ours.shape, ours.layout) == (theirs.dtype, theirs.shape, theirs.layout)
        if ours.layout == torch.strided:
            assert ours.stride() == theirs.stride()
            assert ours.storage_offset() == theirs.storage_offset()
            assert torch.equal(ours, theirs)
        else:
            assert torch.equal(ours.to_dense(), theirs.to_dense())
    else:
        assert ours == theirs


class Cursor:
    """A stand-in for TokenDataLoader: an offset into an immutable stream named by its digest."""

    def __init__(self, manifest_digest: str, length: int = 100_000) -> None:
        self.manifest_digest = manifest_digest
        self.length = length
        self.offset = 0

    def next_tokens(self, count: int) -> torch.Tensor:
        stride = random.randint(1, 3)  # Python's generator shapes the stream
        start = self.offset
        self.offset += count * stride
        return (torch.arange(start, start + count * stride, stride) * 7919) % VOCAB

    def state_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "manifest_digest": self.manifest_digest}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("manifest_digest") != self.manifest_digest:
            raise ValueError(
                f"cursor of other data: {state.get('manifest_digest')!r}, this stream "
                f"{self.manifest_digest!r}"
            )
        if not (type(state.get("offset")) is int and state["offset"] >= 0):
            raise ValueError(f"offset {state.get('offset')!r} is not a non-negative integer")
        if state["offset"] > self.length:
            raise ValueError(f"offset {state['offset']} is past the end ({self.length})")
        self.offset = state["offset"]


class Field:
    """One attribute of a ``Run`` (its counters, its scaler state) as a checkpoint component.

    ``check`` judges a saved state before it is taken, as a trainer's counters would.
    """

    def __init__(self, run: Run, name: str, check: Callable[[Any], None] | None = None) -> None:
        self.run, self.name, self.check = run, name, check

    def state_dict(self) -> Any:
        return getattr(self.run, self.name)

    def load_state_dict(self, state: Any) -> None:
        if self.check is not None:
            self.check(state)
        setattr(self.run, self.name, None if state is None else dict(state))


def check_counters(state: Any) -> None:
    """What a trainer's counters component refuses: a missing or non-count counter."""
    missing = [name for name in ("step", "tokens_seen", "skipped_updates") if name not in state]
    if missing:
        raise ValueError(f"counters lack {missing}")
    bad = [
        f"{name}={value!r}"
        for name, value in state.items()
        if value is not None and not (type(value) is int and value >= 0)
    ]
    if bad:
        raise ValueError(f"counters must be non-negative integers: {', '.join(bad)}")


def check_scaler(state: Any) -> None:
    if state is not None and not isinstance(state, Mapping):
        raise ValueError(f"grad_scaler must be a mapping or None, got {type(state).__name__}")


class TinyLM(nn.Module):
    def __init__(self, d_model: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.norm = nn.LayerNorm(d_model)
        self.up = nn.Linear(d_model, 4 * d_model)
        self.down = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        noise = torch.from_numpy(np.random.standard_normal(x.shape)).to(x.device, x.dtype)
        x = self.norm(x + 0.01 * noise)
        x = x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))
        return self.head(x)


def train_config(**changes: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "batch_size": 4,
        "seq_len": 8,
        "lr": 3e-3,
        "weight_decay": 0.1,
        "max_steps": 20,
        "lr_schedule": "cosine",
        "warmup_steps": 2,
        "min_lr_ratio": 0.1,
        "precision": "fp32",
        "betas": (0.9, 0.95),
    }
    config.update(changes)
    return config


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loaders: dict[str, Cursor]
    counters: dict[str, int | None] = field(
        default_factory=lambda: {
            "step": 0,
            "tokens_seen": 0,
            "skipped_updates": 0,
            "fixed_batch_offset": None,
        }
    )
    train_config: dict[str, Any] = field(default_factory=train_config)
    model_config: dict[str, Any] = field(default_factory=lambda: {"d_model": 16, "n_layers": 1})
    vocab_size: int = VOCAB
    qk_clip_policy: dict[str, Any] | None = field(
        default_factory=lambda: {"tau": 100.0, "gqa_mode": "query_only", "enabled": True}
    )
    qk_clip_geometry: dict[str, Any] | None = field(
        default_factory=lambda: {"attn.0": {"kind": "mha", "n_heads": 2, "head_dim": 8}}
    )
    grad_scaler: dict[str, Any] | None = None

    def step(self) -> None:
        """One update: batch, forward, backward, optimizer step, gradients cleared."""
        device = next(self.model.parameters()).device
        tokens = self.loaders["train"].next_tokens(33).view(1, 33).to(device)
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loaders["val"].next_tokens(4)
        self.counters["step"] = int(self.counters["step"] or 0) + 1
        self.counters["tokens_seen"] = int(self.counters["tokens_seen"] or 0) + 32

    def components(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "counters": Field(self, "counters", check_counters),
            "grad_scaler": Field(self, "grad_scaler", check_scaler),
            "loaders": self.loaders,
        }

    def metadata(self) -> dict[str, Any]:
        qk_clip = None
        if self.qk_clip_policy is not None or self.qk_clip_geometry is not None:
            qk_clip = {"policy": self.qk_clip_policy, "geometry": self.qk_clip_geometry}
        return {
            "train_config": self.train_config,
            "model_config": self.model_config,
            "vocab_size": self.vocab_size,
            "qk_clip": qk_clip,
        }

    def save_kwargs(self) -> dict[str, Any]:
        return {"components": self.components(), "metadata": self.metadata()}

    load_kwargs = save_kwargs


def make_run(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    digests: tuple[str, str] = ("train-manifest-sha", "val-manifest-sha"),
) -> Run:
    """A fresh run; ``seed`` seeds every generator, so different seeds give different states."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = TinyLM().to(device, dtype)
    build = optimizer or (lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1))
    loaders = {"train": Cursor(digests[0]), "val": Cursor(digests[1], length=1_000)}
    return Run(model=model, optimizer=build(model), loaders=loaders)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _digest_of(value: Any, hasher: Any) -> None:
    if isinstance(value, torch.Tensor):
        hasher.update(f"T{value.dtype}{list(value.shape)}".encode())
        hasher.update(tensor_bytes(value))
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            hasher.update(f"K{key!r}".encode())
            _digest_of(value[key], hasher)
    elif isinstance(value, (list, tuple)):
        hasher.update(f"L{len(value)}".encode())
        for item in value:
            _digest_of(item, hasher)
    else:
        hasher.update(f"V{value!r}".encode())


def tree_digest(value: Any) -> str:
    """sha256 over a nested structure of tensors and plain values."""
    hasher = hashlib.sha256()
    _digest_of(value, hasher)
    return hasher.hexdigest()


def run_fingerprint(run: Run) -> dict[str, str]:
    """Hashes of everything a rejected load must not touch."""
    return {
        "model": tree_digest(run.model.state_dict()),
        "optimizer": tree_digest(run.optimizer.state_dict()),
        "loaders": tree_digest(
            {name: loader.state_dict() for name, loader in run.loaders.items()}
        ),
        "counters": tree_digest(run.counters),
        "grad_scaler": tree_digest(run.grad_scaler),
        "rng": tree_digest(capture_rng()),
    }


def rewrite(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Doctor a checkpoint's payload and write it back with a fresh, valid digest."""
    payload = read_payload(path)
    change(payload)
    write_payload(path, payload)


def eventually(condition: Callable[[], bool], seconds: float = 30.0) -> bool:
    """Whether ``condition()`` became true within ``seconds`` (polled every millisecond):
    for what a worker thread or another process does in its own time."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
