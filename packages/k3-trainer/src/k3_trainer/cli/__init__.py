"""The ``k3-train`` command: prepare data, train (fresh, ``--resume`` or ``--init-from`` a
hub folder), evaluate, sample, export to the hub format, inspect, report.

Each subcommand is a dataclass of options (:mod:`.options`, whose fields become its
flags) and a module with its ``run``; ``train`` also takes one flag per field of
``TrainConfig`` and of the chosen model's config (:mod:`.flags`).

User errors (bad flag or config value, missing data, an incompatible or corrupt
checkpoint, a run directory that already holds a run) print one line and exit with
status 2, without a traceback. A run that fails while it trains (a non-finite loss, a
checkpoint that cannot be written, any other I/O error) prints one line and exits with
status 1; the last checkpoint written stays valid. Ctrl-C or SIGTERM while it trains
saves at the next update boundary, says so in one line and exits 130 or 143 (a second
signal ends it at once, the previous checkpoint intact).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, NoReturn

# Only torch-free modules here: --help and argument errors answer before torch is
# imported (a subcommand's module is imported once the arguments parse).
from ..config import ConfigError, TrainConfig
from ..models import DEFAULT_MODEL, ModelSpec, get_model_spec
from ..record import RunRecord
from ..torchrun import launched_by_torchrun, launched_rank, leave_worker
from .flags import add_config_flags, add_option_flags, options_from, shown
from .launch import prog_name, relaunch
from .options import COMMANDS, MODEL_FLAG, TRAIN_FLAG, TrainCommand


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (the full usage of ``train`` lists every config field)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _preset_note(spec: ModelSpec) -> Any:
    def note(name: str, default: Any) -> str:
        if not spec.presets:
            return f"default: {shown(default)}"
        values = {getattr(config, name) for config in spec.presets.values()}
        if len(values) == 1:
            return f"default: {shown(values.pop())}"
        return "default: the preset's; " + ", ".join(
            f"{preset} {shown(getattr(config, name))}" for preset, config in spec.presets.items())
    return note


def build_parser(model: str = DEFAULT_MODEL) -> argparse.ArgumentParser:
    """Every subcommand's flags; ``train``'s model flags are those of the model ``model``."""
    parser = _Parser(
        prog="k3-train",
        description="Pretraining of Kimi-K3-style models, on one device or many (torchrun).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    spec = get_model_spec(model)
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(name, help=command.help)
        choices = {"preset": tuple(spec.presets)} if command.options is TrainCommand else {}
        add_option_flags(subparser, command.options, choices=choices)
        if command.options is TrainCommand:
            _add_config_groups(subparser, spec)
    return parser


def _add_config_groups(train: argparse.ArgumentParser, spec: ModelSpec) -> None:
    add_config_flags(train.add_argument_group(
        "training recipe (TrainConfig)",
        "Each flag overrides the config file's [train] value and, on resume, the run's "
        "recorded value."), TrainConfig, dest_prefix=TRAIN_FLAG)
    try:
        add_config_flags(train.add_argument_group(
            f"model shape ({spec.config_class.__name__}, model {spec.name})",
            "Each flag overrides the preset and the config file's [model] value; a resumed "
            "run keeps its model. Unless set, vocab_size grows to the data's tokenizer."),
            spec.config_class, dest_prefix=MODEL_FLAG, default_note=_preset_note(spec))
    except argparse.ArgumentError as exc:
        raise ConfigError(f"model {spec.name!r}: its config field {exc.argument_name} is "
                          "also a k3-train train flag; rename the field") from None


def _model_of(argv: list[str]) -> str:
    """The model whose flags ``train`` takes: ``--model``, else a resumed run's recorded
    one, else the default (read before the full parse, which depends on it)."""
    if not argv or argv[0] != "train":
        return DEFAULT_MODEL
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--model")
    first.add_argument("--run-dir", type=Path)
    first.add_argument("--resume", action="store_true")
    known, _ = first.parse_known_args(argv[1:])
    if known.model is not None:
        return str(known.model)
    if known.resume and known.run_dir is not None:
        try:
            return RunRecord.read(known.run_dir, partial=True).model
        except (OSError, ValueError):
            pass  # resolving says what is wrong with the run directory
    return DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    status = _main(argv)
    if argv is None and launched_by_torchrun():  # a worker process of its own
        leave_worker(status)  # the gloo exit abort: see leave_worker
    return status


def _main(argv: list[str] | None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(_model_of(arguments))
    except ConfigError as exc:
        print(f"k3-train: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(arguments)
    subcommand = COMMANDS[args.command]
    options = options_from(args, subcommand.options)
    if isinstance(options, TrainCommand) and options.nproc is not None \
            and not launched_by_torchrun():
        if options.parallel == "none":
            print("k3-train: error: --nproc needs --parallel ddp or --parallel fsdp",
                  file=sys.stderr)
            return 2
        from .train import refused_launch

        try:
            refused = refused_launch(options, options.nproc)
        except KeyboardInterrupt:
            print(f"k3-train: interrupted; {_what_is_kept(options)}", file=sys.stderr)
            return 130
        if refused is not None:  # once here, not once per rank under torchrun's report
            print(f"k3-train: error: {refused}", file=sys.stderr)
            return 2
        return relaunch(options.nproc, arguments)
    from k3_checkpoint import CheckpointError

    from ..data import DataError
    from ..interrupt import TrainingInterrupted
    from ..session import RunError
    from .threads import set_default_threads

    who = prog_name()
    # The process-wide CPU thread default is the command's only when it owns the process
    # (a console script or ``python -m``), never a program's that calls main(argv).
    thread_note = set_default_threads() if argv is None else None
    try:
        module = importlib.import_module(f".{subcommand.module}", __name__)
        status: int = module.run(options, (thread_note,) if thread_note else ())
        return status
    except (ConfigError, DataError, CheckpointError, RunError, FileNotFoundError) as exc:
        print(f"{who}: error: {exc}", file=sys.stderr)
        return 2
    except FloatingPointError as exc:
        print(f"{who}: training diverged: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # disk full, a vanished run directory, ...: the environment
        print(f"{who}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except TrainingInterrupted as stop:
        if launched_rank() == 0:
            saved = ("checkpoint saved; continue with --resume" if stop.checkpoint is not None
                     else "nothing was saved")
            print(f"{who}: interrupted at step {stop.step}; {saved}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:  # before training began (or a command that does not train)
        print(f"{who}: interrupted; {_what_is_kept(options)}", file=sys.stderr)
        return 130


def _what_is_kept(options: object) -> str:
    """What an interrupted command leaves, without naming a checkpoint that does not exist."""
    if not isinstance(options, TrainCommand):
        return "nothing was changed"
    from ..checkpoint import find_checkpoint

    if find_checkpoint(options.run_dir) is None:
        return "no checkpoint was written"
    return "the run's last checkpoint is intact; continue with --resume"


def _one_line(exc: OSError) -> str:
    return " ".join(str(exc).split())


__all__ = ["build_parser", "main"]
