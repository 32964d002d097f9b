"""A run as a library object: from a typed request to a trained run, and a run (or a hub
folder) opened at a step for reading. The command line (:mod:`k3_trainer.cli`) only
parses its flags into a :class:`TrainRequest`, calls these and prints.

- :mod:`.request`: :class:`TrainRequest`, what a training session is asked to do;
- :mod:`.config_file`: the TOML config file (``preset``, ``[train]``, ``[model]``,
  ``[data.sources]``);
- :mod:`.run_dir`: what a run directory holds (its record, its checkpoints by step);
- :mod:`.plan`: :func:`resolve`, the session's :class:`Plan` before anything is built;
- :mod:`.build`: the device, loaders, model and ``Trainer`` a plan builds;
- :mod:`.execute`: :func:`execute` a plan, or :func:`train` a request end to end
  (:func:`check_before_launch`: what it would refuse, before its processes start);
- :mod:`.opened`: :func:`open_model`, :func:`restore`, :func:`pretrained` for reading;
- :mod:`.messages`: how a session says what it does (a ``say`` callable).
"""

from .build import build_trainer, loaders, parse_device, seed_everything
from .execute import check_before_launch, execute, train
from .messages import Say
from .opened import Opened, Restored, open_model, pretrained, restore
from .plan import Plan, resolve
from .request import TrainRequest
from .run_dir import RunError, RunState, checkpoint_at, read_record, run_state

__all__ = [
    "Opened",
    "Plan",
    "Restored",
    "RunError",
    "RunState",
    "Say",
    "TrainRequest",
    "build_trainer",
    "check_before_launch",
    "checkpoint_at",
    "execute",
    "loaders",
    "open_model",
    "parse_device",
    "pretrained",
    "read_record",
    "resolve",
    "restore",
    "run_state",
    "seed_everything",
    "train",
]
