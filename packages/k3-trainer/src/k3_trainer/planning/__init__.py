"""Know before launch: memory per rank, FLOPs and step time of a layout, and the
layouts that fit (``k3-train plan``). One concept per module: :mod:`.inventory` (the
model's parameters, read from the meta device), :mod:`.layout` (degrees and the
refusals the trainer uses at launch), :mod:`.memory` (model state per rank),
:mod:`.activations`, :mod:`.comm` (bytes sent per step), :mod:`.gpus`, :mod:`.plan`
(one layout's figures), :mod:`.suggest` and :mod:`.measure` (what a real step
allocates, for the tests)."""

from .gpus import GPU, GPUS, gpu
from .inventory import Inventory, Parameter, inventory
from .layout import LayoutError, ParallelLayout, stage_blocks, validate_layout
from .memory import StateBytes, state_bytes
from .plan import Options, Plan, StagePlan, make_plan
from .suggest import suggest

__all__ = ["GPU", "GPUS", "Inventory", "LayoutError", "Options", "ParallelLayout", "Parameter",
           "Plan", "StagePlan", "StateBytes", "gpu", "inventory", "make_plan",
           "stage_blocks", "state_bytes", "suggest", "validate_layout"]
