"""K3Config: the model's whole shape as validated, plain data.

A checkpoint stores ``config.to_dict()`` and compares it on resume, so the config holds
only str/int/float/bool/None values and round-trips through :meth:`K3Config.from_dict`.
Every invalid value or combination raises ``ValueError`` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Attention = Literal["gqa", "mla", "hybrid"]
MLP = Literal["dense", "moe"]
Activation = Literal["swiglu", "situ"]
KDABackend = Literal["auto", "torch", "fla"]
KDADecay = Literal["bounded", "softplus"]
LayerType = Literal["kda", "mla", "gqa"]

KDA_CHUNK_SIZES = (16, 32, 64)


def later(default: Any) -> Any:
    """A field added after 0.1.0: its ``default`` is what a config saved before it existed
    means, so ``to_dict`` leaves it out at that default (see :func:`later_fields`)."""
    return dataclasses.field(default=default, metadata={"later": True})


def later_fields(config: Any) -> dict[str, Any]:
    """``{name: default}`` of a config dataclass's fields declared with :func:`later`."""
    return {f.name: f.default for f in dataclasses.fields(config) if f.metadata.get("later")}


@dataclass(frozen=True)
class K3Config:
    """Shape of a :class:`~k3_model.K3Model` (defaults: a small MHA + MoE model; the
    named presets in :mod:`k3_model.presets` are the Kimi-K3-shaped starting points).

    Attention is ``"hybrid"`` (Kimi K3: Kimi Delta Attention layers with a Gated MLA
    layer every ``full_attention_every`` layers and at the last one, see
    :meth:`layer_types`), ``"mla"`` (every layer MLA) or ``"gqa"`` (every layer GQA), the
    last two for comparison. MLP is ``"dense"`` or ``"moe"`` (a LatentMoE when
    ``moe_latent_dim`` > 0). Each field's docstring says what it sets; it is also the
    field's ``k3-train train --help`` line.
    """

    vocab_size: int = 256
    """Token ids the embedding and the output head cover."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Decoder blocks."""
    n_heads: int = 4
    """Attention heads (query heads for GQA and MLA)."""
    n_kv_heads: int | None = None
    """GQA: key/value heads (unset: n_heads, i.e. MHA)."""
    head_dim: int | None = None
    """GQA: width of each head (unset: d_model // n_heads)."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (RoPE tables are this long)."""
    attention: Attention = "gqa"
    """hybrid: KDA layers with MLA every full_attention_every layers and last (Kimi K3);
    mla or gqa: that in every layer."""
    full_attention_every: int = 4
    """hybrid: one MLA layer per this many layers."""
    q_lora_rank: int = 0
    """MLA: rank of the query's low-rank projection (0: full rank)."""
    kv_lora_rank: int = 64
    """MLA: rank of the shared key/value latent."""
    qk_nope_head_dim: int = 32
    """MLA: per-head query/key dims without position encoding."""
    qk_rope_head_dim: int = 16
    """MLA: per-head query dims that meet the one key slice shared by all heads."""
    v_head_dim: int = 32
    """MLA: per-head value width."""
    mla_norm_eps: float | None = later(None)
    """MLA: epsilon of the query and latent RMSNorms (unset: norm_eps; Kimi Linear's is
    1e-6)."""
    mla_rope: bool | None = None
    """MLA: rotate the shared key slice (unset: K3's choice, off in hybrid, on in mla)."""
    mla_gate: bool | None = None
    """MLA: multiply the output by sigmoid(W_g x) (unset: on in hybrid, off in mla)."""
    kda_heads: int | None = None
    """KDA: heads (unset: n_heads)."""
    kda_head_dim: int | None = None
    """KDA: width of each head (unset: d_model // kda_heads)."""
    kda_conv_size: int = 4
    """KDA: taps of the short causal convolution."""
    kda_chunk_size: int = 64
    """KDA: chunk of the chunked recurrence (16, 32 or 64)."""
    kda_backend: KDABackend = "auto"
    """KDA kernel: torch, fla (CUDA), or auto (fla when usable)."""
    kda_decay: KDADecay = later("bounded")
    """KDA forget gate: bounded (K3: g = kda_gate_lower_bound·σ(exp(A_log)·(f + dt_bias)))
    or softplus (Kimi Linear: g = −exp(A_log)·softplus(f + dt_bias), unbounded)."""
    kda_gate_lower_bound: float = later(-5.0)
    """KDA, bounded decay: the least log decay per step (K3's −5)."""
    kda_output_gate_rank: int = later(0)
    """KDA: rank of the output gate σ(W_g x) (0: full rank, K3's; Kimi Linear's is
    kda_head_dim)."""
    attn_res_block_size: int = 0
    """Layers per block of block Attention Residuals (0: the plain pre-norm residual)."""
    mlp: MLP = "moe"
    """dense: one MLP of width d_ff per layer; moe: dense first layers, then experts."""
    activation: Activation = "swiglu"
    """GLU of every MLP: swiglu, or situ (K3's SiTU-GLU)."""
    d_ff: int = 384
    """Hidden width of a dense MLP."""
    n_experts: int = 8
    """MoE: routed experts per MoE layer."""
    moe_top_k: int = 2
    """MoE: routed experts each token uses (sigmoid router)."""
    n_shared_experts: int = 1
    """MoE: experts every token uses."""
    moe_d_ff: int = 128
    """MoE: hidden width of each expert."""
    moe_latent_dim: int = 0
    """MoE: > 0 makes it a LatentMoE, the routed experts running at this width between a
    down- and an up-projection."""
    n_dense_layers: int = 1
    """MoE: leading layers with a dense MLP instead."""
    routed_scaling: float = 1.0
    """MoE: scale of the routed experts' gate weights."""
    moe_balance: bool = True
    """MoE: the quantile balancer's per-expert router bias."""
    moe_balance_rate: float = 1.0
    """MoE: in (0, 1], how much of the balancer's new bias replaces the old (1: all)."""
    rope_theta: float = 10000.0
    """Base of the rotary position encoding."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm (K3's 1e-5)."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialization."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the training loss, never materializing all logits (0: the plain
    loss)."""

    def __post_init__(self) -> None:
        _check_types(self)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len"):
            _positive(self, name)
        _choice(self, "attention", ("gqa", "mla", "hybrid"))
        _choice(self, "mlp", ("dense", "moe"))
        _choice(self, "activation", ("swiglu", "situ"))
        if self.attention == "gqa":
            self._check_gqa()
        else:
            self._check_mla()
        if self.attention == "hybrid":
            self._check_kda()
        if self.mlp == "dense":
            _positive(self, "d_ff")
        else:
            self._check_moe()
        if self.attn_res_block_size < 0:
            raise ValueError(
                f"K3Config.attn_res_block_size must be ≥ 0 (0 = plain residual), got "
                f"{self.attn_res_block_size}"
            )
        if self.loss_chunk_size < 0:
            raise ValueError(
                f"K3Config.loss_chunk_size must be ≥ 0 (tokens per chunk of the chunked "
                f"loss; 0 = plain loss), got {self.loss_chunk_size}"
            )
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
                f"heads; leave it None (or equal to n_heads) when attention={self.attention!r}"
            )
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _positive(self, name)
        if self.q_lora_rank < 0:
            raise ValueError(
                f"K3Config.q_lora_rank must be ≥ 0 (0 = full-rank query), got {self.q_lora_rank}"
            )
        rope = self.qk_rope_head_dim
        if self.mla_uses_rope and (rope < 2 or rope % 2):
            raise ValueError(
                f"K3Config.qk_rope_head_dim must be even (rotary pairs) and ≥ 2, got {rope}; "
                "or set mla_rope=False (NoPE: the shared key slice is not rotated)"
            )
        if self.mla_norm_eps is not None and not self.mla_norm_eps > 0:
            raise ValueError(f"K3Config.mla_norm_eps must be > 0 or None (= norm_eps), got "
                             f"{self.mla_norm_eps!r}")
        if not self.mla_uses_rope and rope < 1:
            raise ValueError(
                f"K3Config.qk_rope_head_dim must be ≥ 1 (the key slice shared by all heads), "
                f"got {rope}"
            )

    def _check_kda(self) -> None:
        _positive(self, "full_attention_every")
        if self.kda_heads is not None:
            _positive(self, "kda_heads")
        if self.kda_head_dim is not None:
            _positive(self, "kda_head_dim")
        elif self.d_model % self.kda_n_heads:
            raise ValueError(
                f"K3Config.kda_head_dim: d_model ({self.d_model}) is not a multiple of the "
                f"KDA heads ({self.kda_n_heads}); set kda_head_dim explicitly"
            )
        _positive(self, "kda_conv_size")
        if self.kda_chunk_size not in KDA_CHUNK_SIZES:
            raise ValueError(
                f"K3Config.kda_chunk_size must be one of {KDA_CHUNK_SIZES}, got "
                f"{self.kda_chunk_size!r}"
            )
        _choice(self, "kda_backend", ("auto", "torch", "fla"))
        _choice(self, "kda_decay", ("bounded", "softplus"))
        bound = self.kda_gate_lower_bound
        if not (math.isfinite(bound) and bound < 0):
            raise ValueError(f"K3Config.kda_gate_lower_bound must be a finite number < 0 "
                             f"(K3's is -5), got {bound!r}")
        if self.kda_output_gate_rank < 0:
            raise ValueError(f"K3Config.kda_output_gate_rank must be ≥ 0 (0 = full rank), "
                             f"got {self.kda_output_gate_rank}")

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
        if self.moe_latent_dim < 0:
            raise ValueError(
                f"K3Config.moe_latent_dim must be ≥ 0 (0 = experts at full width), got "
                f"{self.moe_latent_dim}"
            )
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

    def layer_types(self) -> list[LayerType]:
        """Each layer's token mixer: ``"gqa"``/``"mla"`` everywhere, or for ``"hybrid"``
        ``"mla"`` at 0-based layers ``full_attention_every − 1, 2·full_attention_every − 1,
        …`` and at the last layer, ``"kda"`` elsewhere."""
        if self.attention != "hybrid":
            return [self.attention] * self.n_layers
        every, last = self.full_attention_every, self.n_layers - 1
        return ["mla" if (i + 1) % every == 0 or i == last else "kda"
                for i in range(self.n_layers)]

    @property
    def mla_uses_rope(self) -> bool:
        """Whether MLA rotates its shared key slice (``mla_rope``; None: not in hybrid)."""
        return self.attention != "hybrid" if self.mla_rope is None else self.mla_rope

    @property
    def mla_gated(self) -> bool:
        """Whether MLA has the sigmoid output gate (``mla_gate``; None: in hybrid only)."""
        return self.attention == "hybrid" if self.mla_gate is None else self.mla_gate

    @property
    def uses_rope(self) -> bool:
        """Whether any layer needs rotary tables."""
        return self.attention == "gqa" or self.mla_uses_rope

    @property
    def latent_norm_eps(self) -> float:
        """Epsilon of MLA's query and latent RMSNorms (``mla_norm_eps``, else ``norm_eps``)."""
        return self.norm_eps if self.mla_norm_eps is None else self.mla_norm_eps

    @property
    def kda_n_heads(self) -> int:
        """KDA heads: ``kda_heads``, or ``n_heads`` when None."""
        return self.n_heads if self.kda_heads is None else self.kda_heads

    @property
    def kda_dim(self) -> int:
        """KDA head dim (K = V): ``kda_head_dim``, or ``d_model // kda_n_heads`` when None."""
        return self.kda_head_dim if self.kda_head_dim is not None else (
            self.d_model // self.kda_n_heads)

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
        """Per-head query/key dim of the softmax layers (scale ``qk_dim ** -0.5``)."""
        if self.attention == "gqa":
            return self.attn_head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def value_dim(self) -> int:
        """Per-head value dim of the softmax layers."""
        return self.attn_head_dim if self.attention == "gqa" else self.v_head_dim

    @property
    def rope_dim(self) -> int:
        """Dims that carry rotary position: the whole head (GQA) or the rope part (MLA)."""
        return self.attn_head_dim if self.attention == "gqa" else self.qk_rope_head_dim

    @property
    def moe_width(self) -> int:
        """Width the routed experts run at: ``moe_latent_dim``, or ``d_model`` when 0."""
        return self.moe_latent_dim or self.d_model

    def is_moe_layer(self, index: int) -> bool:
        """True when layer ``index`` has a MoE MLP (``mlp == "moe"`` and past the dense ones)."""
        return self.mlp == "moe" and index >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    # --- plain data ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (str/int/float/bool/None), what a checkpoint stores and compares.

        Fields added after 0.1.0 (declared with :func:`later`) are left out while they hold
        their default, which is the meaning a config saved before they existed has: such a
        checkpoint still compares equal, and ``from_dict`` fills them back in.
        """
        data = dataclasses.asdict(self)
        for name, default in later_fields(self).items():
            if data[name] == default:
                del data[name]
        return data

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


LATER_FIELDS: Mapping[str, Any] = later_fields(K3Config)
"""Fields added after 0.1.0 with the default that keeps an older config's meaning."""

_INT_OR_NONE = ("n_kv_heads", "head_dim", "kda_heads", "kda_head_dim")
_FLOAT_OR_NONE = ("mla_norm_eps",)
_BOOL_OR_NONE = ("mla_rope", "mla_gate")
_STRINGS = ("attention", "mlp", "activation", "kda_backend", "kda_decay")


def _check_types(config: K3Config) -> None:
    """Plain-data types only, so the config round-trips exactly through a checkpoint."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        default = field.default
        if field.name in _INT_OR_NONE:
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
            want = "an int or None"
        elif field.name in _FLOAT_OR_NONE:
            ok = value is None or (isinstance(value, (int, float))
                                   and not isinstance(value, bool))
            want = "a number or None"
            if ok and isinstance(value, int):
                object.__setattr__(config, field.name, float(value))
        elif field.name in _BOOL_OR_NONE:
            ok, want = value is None or isinstance(value, bool), "True, False or None"
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
