"""The runtime signature: the software, device and kernel settings bitwise resume depends on.

Same data and same saved state are not enough for a bit-identical continuation: a different
torch build, device, parameter dtype, intra-op thread count (reduction order on CPU) or
determinism setting changes the arithmetic. The signature records each, and the loader refuses a
mismatch unless the caller's policy explicitly gives that key up.
"""

from __future__ import annotations

from typing import Any

import torch

from .plain import to_plain

__all__ = ["runtime_signature"]


def runtime_signature(*modules: torch.nn.Module) -> dict[str, Any]:
    """Plain-data description of the runtime ``modules`` train under.

    Device types and parameter dtypes are sorted lists over all their parameters (a model may
    mix them); the rest are process-wide settings read at call time.
    """
    parameters = [parameter for module in modules for parameter in module.parameters()]
    signature = {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device_type": sorted({parameter.device.type for parameter in parameters}),
        "param_dtype": sorted({str(parameter.dtype) for parameter in parameters}),
        "num_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    # torch.__version__ is a str subclass that weights_only loading refuses; store plain data.
    return dict(to_plain(signature, "runtime"))
