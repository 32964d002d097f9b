"""QKClipPolicy: validation and plain-dict round trip."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from k3_qkclip import QKClipPolicy


def test_defaults_and_plain_dict_round_trip():
    policy = QKClipPolicy()
    assert policy.to_dict() == {"enabled": True, "tau": 100.0, "gqa": "query_only"}
    other = QKClipPolicy(enabled=False, tau=30, gqa="group_min")
    data = other.to_dict()
    assert isinstance(data["tau"], float)  # int τ stored as float: compares equal after JSON
    assert QKClipPolicy.from_dict(json.loads(json.dumps(data))) == other
    assert QKClipPolicy.from_dict({"tau": 30.0}) == QKClipPolicy(tau=30.0)


@pytest.mark.parametrize("tau", [0, -1.0, math.nan, math.inf, True, "100", None])
def test_tau_must_be_a_positive_finite_number(tau):
    with pytest.raises(ValueError, match="tau"):
        QKClipPolicy(tau=tau)


def test_unknown_gqa_mode_and_non_bool_enabled_are_rejected():
    with pytest.raises(ValueError, match="query_only, group_min"):
        QKClipPolicy(gqa="per_head")
    with pytest.raises(ValueError, match="enabled"):
        QKClipPolicy(enabled=1)


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="threshold"):
        QKClipPolicy.from_dict({"tau": 100.0, "threshold": 3})


def test_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QKClipPolicy().tau = 3.0  # type: ignore[misc]
