"""k3-qkclip: model-agnostic QK-Clip (Kimi K2 §2.1) with exact per-head observation."""

from importlib.metadata import PackageNotFoundError, version

from .clip import OBSERVER_ATTR, SPEC_METHOD, QKClip
from .clip_report import QKClipModuleReport, QKClipReport
from .observe import QKObserver, head_max_logits, observed_attention
from .policy import GQA_MODES, QKClipPolicy
from .spec import QKSpec, RowBlock, RowLayout, Segment

try:
    __version__ = version("k3-qkclip")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "GQA_MODES",
    "OBSERVER_ATTR",
    "SPEC_METHOD",
    "QKClip",
    "QKClipModuleReport",
    "QKClipPolicy",
    "QKClipReport",
    "QKObserver",
    "QKSpec",
    "RowBlock",
    "RowLayout",
    "Segment",
    "__version__",
    "head_max_logits",
    "observed_attention",
]
