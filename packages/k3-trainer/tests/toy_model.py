"""A model that is not K3, for the tests of model specs: the smallest thing the trainer
can train (an embedding, one mixing matrix, a head), with a documented config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from k3_trainer.models import ModelSpec


@dataclass(frozen=True)
class ToyConfig:
    vocab_size: int = 256
    """tokens the toy reads"""
    d_model: int = 16
    """width of the toy's hidden state"""
    max_seq_len: int = 64
    """the longest sequence the toy takes"""

    def __post_init__(self) -> None:
        if self.d_model < 1:
            raise ValueError(f"ToyConfig: d_model must be >= 1, got {self.d_model}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.mix = nn.Linear(config.d_model, config.d_model, bias=False)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.embed(x)
        hidden = hidden + torch.tanh(self.mix(hidden))
        logits = self.head(hidden)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


SPEC = ModelSpec(name="toy", config_class=ToyConfig, build=ToyModel,
                 presets={"narrow": ToyConfig(d_model=8), "wide": ToyConfig(d_model=32)},
                 default_preset="narrow")
