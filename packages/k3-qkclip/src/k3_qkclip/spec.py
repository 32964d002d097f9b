"""QKSpec: how an attention module declares its QK-Clip geometry.

A declaration says, for every weight that holds query or key rows, how its rows (dim 0)
are laid out top to bottom: a sequence of blocks, each ``repeat`` copies of a few named
parts. The i-th ``q`` part (in declaration order) is query head i, the i-th ``k`` part
key/value head i, and so on. Knowing every row's role is what lets QK-Clip scale exactly
the rows that feed head h's logits, and check that the declaration tiles the weight.

Roles: ``q`` / ``k`` (MHA, GQA: whole head, RoPE included, since RoPE is a rotation and
commutes with scaling), ``q_nope`` / ``k_nope`` / ``q_rope`` (MLA per-head parts),
``k_rope`` (MLA shared rotary key, never scaled), ``v`` / ``other`` (never scaled).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["mha", "gqa", "mla"]
Role = Literal["q", "k", "q_nope", "q_rope", "k_nope", "k_rope", "v", "other"]

KINDS: tuple[str, ...] = ("mha", "gqa", "mla")
_ROLES_BY_KIND: dict[str, frozenset[str]] = {
    "mha": frozenset({"q", "k", "v", "other"}),
    "gqa": frozenset({"q", "k", "v", "other"}),
    "mla": frozenset({"q_nope", "q_rope", "k_nope", "k_rope", "v", "other"}),
}


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class RowBlock:
    """``repeat`` consecutive copies of ``parts`` (``(role, rows)`` pairs).

    ``RowBlock(8, (("q_nope", 64), ("q_rope", 32)))`` is 8 heads of 96 rows each.
    """

    repeat: int
    parts: tuple[tuple[Role, int], ...]

    def __post_init__(self) -> None:
        _positive_int(self.repeat, "RowBlock.repeat")
        parts = tuple((role, n) for role, n in self.parts)
        if not parts:
            raise ValueError("RowBlock.parts must not be empty")
        for role, n in parts:
            _positive_int(n, f"RowBlock part {role!r} rows")
        object.__setattr__(self, "parts", parts)

    @property
    def rows(self) -> int:
        return self.repeat * sum(n for _, n in self.parts)


@dataclass(frozen=True)
class RowLayout:
    """The rows of one weight, top to bottom; they must tile its dim 0 exactly.

    ``target`` is a name relative to the declaring module: a submodule with ``weight``
    (rows on dim 0) and optional ``bias``, which scales with its rows, or a parameter.
    """

    target: str
    blocks: tuple[RowBlock, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or not self.target:
            raise ValueError(f"RowLayout.target must be a non-empty name, got {self.target!r}")
        blocks = tuple(self.blocks)
        if not blocks or not all(isinstance(b, RowBlock) for b in blocks):
            raise ValueError(f"RowLayout {self.target!r}: blocks must be non-empty RowBlocks")
        object.__setattr__(self, "blocks", blocks)

    @property
    def rows(self) -> int:
        return sum(b.rows for b in self.blocks)


@dataclass(frozen=True)
class Segment:
    """One contiguous run of rows: ``target[start:stop]`` is part ``role`` of ``index``."""

    target: str
    role: str
    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class QKSpec:
    """An attention module's QK-Clip geometry (see the module docstring for roles).

    Most modules use a constructor: :meth:`mha`, :meth:`gqa` or :meth:`mla`. For GQA,
    query head h reads key/value head ``h // (n_heads // n_kv_heads)``, the convention of
    ``repeat_interleave`` and of ``scaled_dot_product_attention(enable_gqa=True)``.
    """

    kind: Kind
    n_heads: int
    n_kv_heads: int
    layouts: tuple[RowLayout, ...]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QKSpec.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        h = _positive_int(self.n_heads, "QKSpec.n_heads")
        kv = _positive_int(self.n_kv_heads, "QKSpec.n_kv_heads")
        if self.kind in ("mha", "mla") and kv != h:
            raise ValueError(f"QKSpec({self.kind}): n_kv_heads ({kv}) must equal n_heads ({h})")
        if self.kind == "gqa" and h % kv:
            raise ValueError(f"QKSpec(gqa): n_heads ({h}) must be a multiple of n_kv_heads ({kv})")
        layouts = tuple(self.layouts)
        if not layouts or not all(isinstance(x, RowLayout) for x in layouts):
            raise ValueError("QKSpec.layouts must be a non-empty sequence of RowLayout")
        targets = [x.target for x in layouts]
        if len(set(targets)) != len(targets):
            raise ValueError(f"QKSpec: a target is declared twice in {targets}")
        object.__setattr__(self, "layouts", layouts)
        self._check_roles()

    def _check_roles(self) -> None:
        allowed = _ROLES_BY_KIND[self.kind]
        sizes: dict[str, set[int]] = {}
        counts: dict[str, int] = {}
        for layout in self.layouts:
            for block in layout.blocks:
                for role, n in block.parts:
                    if role not in allowed:
                        raise ValueError(
                            f"QKSpec({self.kind}): role {role!r} in {layout.target!r} is not "
                            f"one of {', '.join(sorted(allowed))}"
                        )
                    sizes.setdefault(role, set()).add(n)
                    counts[role] = counts.get(role, 0) + block.repeat
        if self.kind == "mla":
            want = {"q_nope": self.n_heads, "q_rope": self.n_heads, "k_nope": self.n_heads}
            pairs = [("q_nope", "k_nope"), ("q_rope", "k_rope")]
            if counts.get("k_rope", 0) > 1:
                raise ValueError("QKSpec(mla): the shared rotary key (k_rope) is declared twice")
        else:
            want = {"q": self.n_heads, "k": self.n_kv_heads}
            pairs = [("q", "k")]
        for name, n in want.items():
            if counts.get(name, 0) != n:
                raise ValueError(
                    f"QKSpec({self.kind}): expected {n} {name!r} parts (one per head), "
                    f"declared {counts.get(name, 0)}"
                )
        for name, found in sizes.items():
            if name not in ("v", "other") and len(found) != 1:
                raise ValueError(f"QKSpec: {name!r} parts differ in size: {sorted(found)}")
        for a, b in pairs:
            if a in sizes and b in sizes and sizes[a] != sizes[b]:
                raise ValueError(
                    f"QKSpec({self.kind}): {a!r} parts have {min(sizes[a])} rows but {b!r} "
                    f"parts {min(sizes[b])}; a query and its key must have the same dim"
                )

    # --- constructors for the common layouts -------------------------------------------

    @classmethod
    def mha(
        cls,
        n_heads: int,
        head_dim: int,
        *,
        q: str | None = None,
        k: str | None = None,
        qkv: str | None = None,
        v_dim: int | None = None,
    ) -> QKSpec:
        """Multi-head attention: ``q`` and ``k`` (default ``q_proj``/``k_proj``) hold
        ``n_heads`` blocks of ``head_dim`` rows, or one fused ``qkv`` weight holds
        ``[q heads | k heads | v heads]``."""
        return cls.gqa(n_heads, n_heads, head_dim, q=q, k=k, qkv=qkv, v_dim=v_dim, kind="mha")

    @classmethod
    def gqa(
        cls,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        q: str | None = None,
        k: str | None = None,
        qkv: str | None = None,
        v_dim: int | None = None,
        kind: Kind = "gqa",
    ) -> QKSpec:
        """Grouped-query attention; like :meth:`mha` with ``n_kv_heads`` key heads."""
        if qkv is not None:
            if q is not None or k is not None:
                raise ValueError("QKSpec: give either qkv= (fused) or q=/k=, not both")
            blocks = (
                RowBlock(n_heads, (("q", head_dim),)),
                RowBlock(n_kv_heads, (("k", head_dim),)),
                RowBlock(n_kv_heads, (("v", v_dim or head_dim),)),
            )
            return cls(kind, n_heads, n_kv_heads, (RowLayout(qkv, blocks),))
        return cls(
            kind,
            n_heads,
            n_kv_heads,
            (
                RowLayout(q or "q_proj", (RowBlock(n_heads, (("q", head_dim),)),)),
                RowLayout(k or "k_proj", (RowBlock(n_kv_heads, (("k", head_dim),)),)),
            ),
        )

    @classmethod
    def mla(
        cls,
        n_heads: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        *,
        q: str = "q_proj",
        kv: str = "kv_proj",
        k_rope: str | None = None,
        k_rope_offset: int = 0,
    ) -> QKSpec:
        """Multi-head latent attention (DeepSeek-V2 / Kimi K2 layout).

        ``q`` rows per head are ``[q_nope | q_rope]``; ``kv`` (the key/value
        up-projection) rows per head are ``[k_nope | v]``; ``k_rope`` optionally names the
        weight that holds the shared rotary key, at rows ``[k_rope_offset,
        k_rope_offset + rope_dim)`` after ``k_rope_offset`` other rows (e.g. the latent).
        The shared key is never scaled; declaring it records it in the geometry.
        """
        layouts = [
            RowLayout(q, (RowBlock(n_heads, (("q_nope", nope_dim), ("q_rope", rope_dim))),)),
            RowLayout(kv, (RowBlock(n_heads, (("k_nope", nope_dim), ("v", v_dim))),)),
        ]
        if k_rope is not None:
            parts: Sequence[tuple[Role, int]] = (("k_rope", rope_dim),)
            if k_rope_offset:
                parts = (("other", k_rope_offset), ("k_rope", rope_dim))
            layouts.append(RowLayout(k_rope, (RowBlock(1, tuple(parts)),)))
        return cls("mla", n_heads, n_heads, tuple(layouts))

    # --- derived views -----------------------------------------------------------------

    def segments(self) -> Iterator[Segment]:
        """Every run of rows, with the head (or kv head) index of its role."""
        seen: dict[str, int] = {}
        for layout in self.layouts:
            row = 0
            for block in layout.blocks:
                for _ in range(block.repeat):
                    for role, n in block.parts:
                        index = seen.get(role, 0)
                        seen[role] = index + 1
                        yield Segment(layout.target, role, index, row, row + n)
                        row += n

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form (part of :meth:`QKClip.geometry`)."""
        return {
            "kind": self.kind,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "layouts": [
                {
                    "target": layout.target,
                    "rows": layout.rows,
                    "blocks": [
                        {"repeat": b.repeat, "parts": [[role, n] for role, n in b.parts]}
                        for b in layout.blocks
                    ],
                }
                for layout in self.layouts
            ],
        }
