"""K3Config: the model's whole shape as validated, plain data.

A checkpoint stores ``config.to_dict()`` and compares it on resume, so the config holds
only str/int/float/bool/None values and round-trips through :meth:`K3Config.from_dict`.
Every invalid value or combination raises ``ValueError`` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Attention = Literal["gqa", "mla"]
MLP = Literal["dense", "moe"]


@dataclass(frozen=True)
class K3Config:
    """Shape of a :class:`~k3_model.K3Model` (defaults: a small MHA + MoE model; the
    named presets in :mod:`k3_model.presets` are the supported starting points).

    Attention is ``"gqa"`` (``n_kv_heads`` key/value heads, ``None`` = ``n_heads`` = MHA;
    ``head_dim`` ``None`` = ``d_model // n_heads``) or ``"mla"`` (multi-head latent
    attention: query rank ``q_lora_rank`` (0 = a full-rank query projection), key/value
    latent rank ``kv_lora_rank``, per-head ``qk_nope_head_dim`` + ``qk_rope_head_dim``
    query/key dims, ``v_head_dim`` value dim; one rotary key shared by all heads).

    MLP is ``"dense"`` (SwiGLU, hidden ``d_ff``) or ``"moe"``: every layer from
    ``n_dense_layers`` on holds ``n_experts`` SwiGLU experts of hidden ``moe_d_ff`` of
    which each token uses ``moe_top_k`` (sigmoid router), plus ``n_shared_experts`` always
    on; gate weights are scaled by ``routed_scaling``. ``moe_balance`` turns the
    quantile balancer on, ``moe_balance_rate`` in (0, 1] blends its new bias with the
    old one (1 = replace).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    max_seq_len: int = 256
    attention: Attention = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    mlp: MLP = "moe"
    d_ff: int = 384
    n_experts: int = 8
    moe_top_k: int = 2
    n_shared_experts: int = 1
    moe_d_ff: int = 128
    n_dense_layers: int = 1
    routed_scaling: float = 1.0
    moe_balance: bool = True
    moe_balance_rate: float = 1.0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive(self, name)
        _choice(self, "attention", ("gqa", "mla"))
        _choice(self, "mlp", ("dense", "moe"))
        if self.attention == "gqa":
            self._check_gqa()
        else:
            self._check_mla()
        if self.mlp == "dense":
            _positive(self, "d_ff")
        else:
            self._check_moe()
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"K3Config.{name} must be > 0, got {getattr(self, name)!r}")

    def _check_gqa(self) -> None:
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"K3Config.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads}); "
                "None means n_kv_heads = n_heads (MHA)"
            )
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"K3Config.head_dim: d_model ({self.d_model}) is not a multiple of n_heads "
                f"({self.n_heads}); set head_dim explicitly"
            )
        hd = self.attn_head_dim
        if hd < 2 or hd % 2:
            raise ValueError(f"K3Config.head_dim must be even (rotary pairs) and ≥ 2, got {hd}")

    def _check_mla(self) -> None:
        if self.n_kv_heads is not None and self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"K3Config.n_kv_heads ({self.n_kv_heads}): MLA has no separate key/value "
                "heads; leave it None (or equal to n_heads) when attention='mla'"
            )
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _positive(self, name)
        if self.q_lora_rank < 0:
            raise ValueError(
                f"K3Config.q_lora_rank must be ≥ 0 (0 = full-rank query), got {self.q_lora_rank}"
            )
        if self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ValueError(
                "K3Config.qk_rope_head_dim must be even (rotary pairs) and ≥ 2, "
                f"got {self.qk_rope_head_dim}"
            )

    def _check_moe(self) -> None:
        for name in ("n_experts", "moe_top_k", "moe_d_ff"):
            _positive(self, name)
        if self.moe_top_k >= self.n_experts:
            raise ValueError(
                f"K3Config.moe_top_k ({self.moe_top_k}) must be < n_experts ({self.n_experts}): "
                "the balancer's cutoff is each token's (k+1)-th expert"
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"K3Config.n_shared_experts must be ≥ 0, got {self.n_shared_experts}")
        if not 0 <= self.n_dense_layers < self.n_layers:
            raise ValueError(
                f"K3Config.n_dense_layers ({self.n_dense_layers}) must be in [0, n_layers) "
                f"= [0, {self.n_layers}) so that at least one layer is MoE; use mlp='dense' "
                "for a model without experts"
            )
        if self.n_dense_layers:
            _positive(self, "d_ff")
        if not self.routed_scaling > 0:
            raise ValueError(f"K3Config.routed_scaling must be > 0, got {self.routed_scaling}")
        if not 0 < self.moe_balance_rate <= 1:
            raise ValueError(
                f"K3Config.moe_balance_rate must be in (0, 1], got {self.moe_balance_rate}"
            )

    # --- derived values ----------------------------------------------------------------

    @property
    def kv_heads(self) -> int:
        """Key/value heads (GQA); ``n_heads`` when ``n_kv_heads`` is None and for MLA."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def attn_head_dim(self) -> int:
        """GQA head dim: ``head_dim``, or ``d_model // n_heads`` when None."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def qk_dim(self) -> int:
        """Per-head query/key dim (the softmax scale is ``qk_dim ** -0.5``)."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.attn_head_dim

    @property
    def value_dim(self) -> int:
        """Per-head value dim."""
        return self.v_head_dim if self.attention == "mla" else self.attn_head_dim

    @property
    def rope_dim(self) -> int:
        """Dims that carry rotary position: the whole head (GQA) or the rope part (MLA)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.attn_head_dim

    def is_moe_layer(self, index: int) -> bool:
        """True when layer ``index`` has a MoE MLP (``mlp == "moe"`` and past the dense ones)."""
        return self.mlp == "moe" and index >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # --- plain data ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (str/int/float/bool/None), what a checkpoint stores and compares."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> K3Config:
        """Inverse of :meth:`to_dict`; unknown keys are rejected by name, missing ones default."""
        if not isinstance(data, Mapping):
            raise TypeError(f"K3Config.from_dict needs a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ValueError(
                f"K3Config: unknown field(s) {', '.join(unknown)}; known fields are "
                f"{', '.join(sorted(known))}"
            )
        return cls(**dict(data))

    def replace(self, **changes: Any) -> K3Config:
        """A copy with ``changes`` applied, validated again; unknown names are rejected."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"K3Config: unknown field(s) {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)


_INT_OR_NONE = ("n_kv_heads", "head_dim")
_STRINGS = ("attention", "mlp")


def _check_types(config: K3Config) -> None:
    """Plain-data types only, so the config round-trips exactly through a checkpoint."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        default = field.default
        if field.name in _INT_OR_NONE:
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            want = "an int or None"
        elif field.name in _STRINGS:
            ok, want = isinstance(value, str), "a string"
        elif isinstance(default, bool):
            ok, want = isinstance(value, bool), "a bool"
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
            want = "an int"
        else:  # float fields accept ints (1 == 1.0 compares equal after a round trip)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            want = "a number"
            if ok and isinstance(value, int):
                object.__setattr__(config, field.name, float(value))
        if not ok:
            raise ValueError(f"K3Config.{field.name} must be {want}, got {value!r}")


def _positive(config: K3Config, name: str) -> None:
    value = getattr(config, name)
    if value < 1:
        raise ValueError(f"K3Config.{name} must be ≥ 1, got {value!r}")


def _choice(config: K3Config, name: str, options: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in options:
        raise ValueError(f"K3Config.{name} must be one of {', '.join(options)}, got {value!r}")
