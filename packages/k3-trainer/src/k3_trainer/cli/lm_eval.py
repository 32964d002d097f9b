"""``k3-train lm-eval``: lm-evaluation-harness's ``simple_evaluate`` with the ``k3`` backend
(:mod:`k3_trainer.lm_eval`) on a run directory or a hub folder."""

from __future__ import annotations

import json
import os
from typing import Any

from ..config import ConfigError
from ..record import RUN_RECORD
from .evaluate import write_json
from .options import LmEvalCommand


def run(command: LmEvalCommand, notes: tuple[str, ...] = ()) -> int:
    """Score ``--tasks``; print lm-eval's table and write its results to ``--output``."""
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        raise ConfigError("k3-train lm-eval needs lm-evaluation-harness: pip install "
                          "'k3-trainer[lm-eval]' (lm-eval==0.4.13)") from None
    from ..lm_eval import K3LM

    if not (command.model / RUN_RECORD).is_file() and \
            not (command.model / "config.json").is_file():
        raise ConfigError(f"--model {command.model} is neither a k3-train run directory "
                          f"({RUN_RECORD}) nor a hub folder (config.json)")
    names = [name.strip() for name in command.tasks.split(",") if name.strip()]
    manager = TaskManager(include_path=None if command.include_path is None
                          else str(command.include_path))
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown or not names:
        raise ConfigError(f"--tasks: lm-eval knows no task {', '.join(unknown) or '(none)'}"
                          + ("" if command.include_path else
                             " (local task files: --include-path DIR)"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = K3LM(str(command.model), step=command.step, batch_size=command.batch_size,
                 device=command.device)
    results: Any = lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager,
                                           limit=command.limit,
                                           num_fewshot=command.num_fewshot)
    print(make_table(results))
    if command.output is not None:
        write_json(command.output, json.loads(json.dumps(
            {key: results[key] for key in ("results", "configs", "versions", "n-shot")
             if key in results}, default=str)))
    return 0
