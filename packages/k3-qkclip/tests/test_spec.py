"""QKSpec declarations: layouts, static checks, binding errors and geometry."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from k3_qkclip import QKClip, QKClipPolicy, QKSpec, RowBlock, RowLayout
from k3_qkclip.reference import ReferenceAttention


def runs(spec: QKSpec):
    return [(s.target, s.role, s.index, s.start, s.stop) for s in spec.segments()]


def test_fused_layout_assigns_rows_to_heads_in_order():
    spec = QKSpec.gqa(4, 2, 3, qkv="wqkv")
    got = runs(spec)
    assert got[:4] == [("wqkv", "q", i, 3 * i, 3 * i + 3) for i in range(4)]
    assert got[4:6] == [("wqkv", "k", 0, 12, 15), ("wqkv", "k", 1, 15, 18)]
    assert spec.layouts[0].rows == 24


def test_mla_layout_interleaves_nope_and_rope_per_head():
    spec = QKSpec.mla(
        2, nope_dim=4, rope_dim=2, v_dim=3, q="q", kv="kv", k_rope="a", k_rope_offset=5
    )
    got = runs(spec)
    assert got[:4] == [
        ("q", "q_nope", 0, 0, 4),
        ("q", "q_rope", 0, 4, 6),
        ("q", "q_nope", 1, 6, 10),
        ("q", "q_rope", 1, 10, 12),
    ]
    assert got[4:6] == [("kv", "k_nope", 0, 0, 4), ("kv", "v", 0, 4, 7)]
    assert got[-2:] == [("a", "other", 0, 0, 5), ("a", "k_rope", 0, 5, 7)]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: QKSpec("mha", 4, 2, QKSpec.gqa(4, 2, 8).layouts), "must equal n_heads"),
        (lambda: QKSpec.gqa(4, 3, 8), "multiple of n_kv_heads"),
        (
            lambda: QKSpec(
                "gqa",
                4,
                2,
                (
                    RowLayout("q", (RowBlock(3, (("q", 8),)),)),
                    RowLayout("k", (RowBlock(2, (("k", 8),)),)),
                ),
            ),
            "expected 4 'q' parts",
        ),
        (
            lambda: QKSpec(
                "gqa",
                2,
                2,
                (
                    RowLayout("q", (RowBlock(2, (("q", 8),)),)),
                    RowLayout("k", (RowBlock(2, (("k", 4),)),)),
                ),
            ),
            "same dim",
        ),
        (
            lambda: QKSpec("gqa", 2, 2, (RowLayout("q", (RowBlock(2, (("q_rope", 8),)),)),)),
            "role 'q_rope'",
        ),
        (
            lambda: QKSpec(
                "mha",
                1,
                1,
                (
                    RowLayout("w", (RowBlock(1, (("q", 2),)),)),
                    RowLayout("w", (RowBlock(1, (("k", 2),)),)),
                ),
            ),
            "declared twice",
        ),
        (lambda: RowBlock(2, (("q", 0),)), "positive int"),
        (lambda: QKSpec("sparse", 1, 1, ()), "kind"),  # type: ignore[arg-type]
    ],
)
def test_inconsistent_declarations_are_rejected(build, message):
    with pytest.raises(ValueError, match=message):
        build()


class Declared(nn.Module):
    qk_observer = None

    def __init__(self, spec_rows=8):
        super().__init__()
        self.spec_rows = spec_rows
        self.q_proj = nn.Linear(8, 8)
        self.k_proj = nn.Linear(8, 8)

    def qk_clip_spec(self):
        return QKSpec.mha(2, self.spec_rows // 2)


def test_rows_that_do_not_tile_the_weight_name_the_module():
    model = nn.Sequential(nn.Linear(8, 8), Declared(spec_rows=6))
    with pytest.raises(ValueError, match=r"module '1'.*'q_proj' \(6\).*\(8 rows"):
        QKClip(model)


def test_missing_target_and_missing_observer_attribute_name_the_module():
    class NoTarget(Declared):
        def qk_clip_spec(self):
            return QKSpec.mha(2, 4, q="wq")

    class NoObserver(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)

        def qk_clip_spec(self):
            return QKSpec.mha(2, 4)

    with pytest.raises(ValueError, match=r"module 'attn'.*'wq' is neither"):
        QKClip(nn.ModuleDict({"attn": NoTarget()}))
    with pytest.raises(ValueError, match=r"module 'attn'.*qk_observer"):
        QKClip(nn.ModuleDict({"attn": NoObserver()}))


def test_static_spec_errors_are_prefixed_with_the_module():
    class Bad(Declared):
        def qk_clip_spec(self):
            return QKSpec.gqa(4, 3, 2)

    with pytest.raises(ValueError, match=r"module 'x'.*multiple of n_kv_heads"):
        QKClip(nn.ModuleDict({"x": Bad()}))


def test_a_weight_declared_by_two_modules_is_refused():
    shared = Declared()
    other = Declared()
    other.q_proj = shared.q_proj
    with pytest.raises(ValueError, match=r"'q_proj.weight' is also declared by module 'a'"):
        QKClip(nn.ModuleDict({"a": shared, "b": other}))


def test_no_declaring_module_is_an_error_only_when_enabled():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="no module of Sequential declares"):
        QKClip(model)
    with QKClip(model, QKClipPolicy(enabled=False)) as clip:
        model(torch.zeros(1, 4))
        clip.validate()
        assert clip.apply().to_metrics()["qk_heads_clipped"] == 0
        assert clip.max_logits() == {}


def test_methods_outside_the_context_and_reentry_are_refused():
    model = Declared()
    clip = QKClip(model)
    with pytest.raises(RuntimeError, match="outside"):
        clip.apply()
    with clip, pytest.raises(RuntimeError, match="already"):
        clip.__enter__()
    with clip, pytest.raises(RuntimeError, match="already observed"):
        QKClip(model).__enter__()
    assert not clip.active


def test_geometry_is_plain_comparable_data():
    def model(kv):
        return nn.ModuleDict({"layers": nn.ModuleList([ReferenceAttention(16, 4, kv)])})

    geometry = QKClip(model(2)).geometry()
    assert json.loads(json.dumps(geometry)) == geometry
    assert geometry == QKClip(model(2)).geometry()
    assert geometry != QKClip(model(4)).geometry()
    layer = geometry["modules"]["layers.0"]
    assert (layer["kind"], layer["n_heads"], layer["n_kv_heads"]) == ("gqa", 4, 2)
    assert layer["params"] == {
        "layers.0.q_proj.weight": [16, 16],
        "layers.0.k_proj.weight": [8, 16],
    }


def test_a_target_can_be_a_bare_parameter_with_a_custom_layout():
    class RawWeights(nn.Module):
        qk_observer = None

        def __init__(self):
            super().__init__()
            self.wqk = nn.Parameter(torch.randn(12, 5))  # rows: [q0 q1 | k0 k1 | 4 spare]

        def qk_clip_spec(self):
            blocks = (
                RowBlock(2, (("q", 2),)),
                RowBlock(2, (("k", 2),)),
                RowBlock(1, (("other", 4),)),
            )
            return QKSpec("mha", 2, 2, (RowLayout("wqk", blocks),))

    model = RawWeights()
    before = model.wqk.detach().clone()
    with QKClip(model, QKClipPolicy(tau=4.0)) as clip:
        model.qk_observer.record(torch.tensor([1.0, 16.0]))  # head 1: γ = 1/4
        clip.apply()
    factor = torch.tensor([1, 1, 0.5, 0.5, 1, 1, 0.5, 0.5, 1, 1, 1, 1]).view(-1, 1)
    assert torch.equal(model.wqk.detach(), before * factor)
    assert QKClip(model).geometry()["modules"][""]["params"] == {"wqk": [12, 5]}
