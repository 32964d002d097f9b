"""k3-optim: MuonAdamW (Nesterov Muon + AdamW in one optimizer) and batched Newton–Schulz."""

from importlib.metadata import PackageNotFoundError, version

from .muon import UPDATE_SCALES, matrix_view_shape, update_scale_factor
from .newton_schulz import (
    COEFFICIENT_SETS,
    GRAM_MIN_ASPECT,
    JORDAN,
    NS_METHODS,
    POLAR_EXPRESS,
    POLAR_EXPRESS_SAFETY,
    newton_schulz,
    resolve_ns_dtype,
    resolve_ns_method,
)
from .optimizer import MuonAdamW
from .param_groups import build_parameter_groups, check_parameter_groups

try:
    __version__ = version("k3-optim")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0+unknown"

__all__ = [
    "COEFFICIENT_SETS",
    "GRAM_MIN_ASPECT",
    "JORDAN",
    "NS_METHODS",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_SAFETY",
    "UPDATE_SCALES",
    "MuonAdamW",
    "__version__",
    "build_parameter_groups",
    "check_parameter_groups",
    "matrix_view_shape",
    "newton_schulz",
    "resolve_ns_dtype",
    "resolve_ns_method",
    "update_scale_factor",
]
