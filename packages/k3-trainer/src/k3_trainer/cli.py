"""The ``k3-train`` command: prepare data, train (fresh, ``--resume`` or ``--init-from`` a
hub folder), evaluate, sample, export to the hub format, inspect.

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
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# Only torch-free modules here: --help and argument errors answer before torch is
# imported (main() imports what a command needs once the arguments parse).
from k3_model.config import K3Config
from k3_model.presets import PRESETS

from .config import ConfigError, TrainConfig
from .data.options import DEFAULT_SHARD_TOKENS, DEFAULT_SHUFFLE_SEED
from .flags import add_config_flags, given, shown
from .launch import MODES, launched_by_torchrun, launched_rank, prog_name, torchrun_command

if TYPE_CHECKING:
    import torch

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _preset_default(name: str, _default: Any) -> str:
    values = {getattr(config, name) for config in PRESETS.values()}
    if len(values) == 1:
        return f"default: {shown(values.pop())}"
    return "default: the preset's; " + ", ".join(
        f"{preset} {shown(getattr(config, name))}" for preset, config in PRESETS.items())


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _batches(text: str) -> int | str:
    return "all" if text == "all" else _positive_int(text)


DEVICE_HELP = "auto (cuda when available, else cpu), cpu, cuda or cuda:N (default auto)"

# argparse destinations of the generated flags (no hand-written option starts so).
TRAIN_FLAG, MODEL_FLAG = "train:", "model:"


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (the full usage of ``train`` lists every config field)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="k3-train",
        description="Pretraining of Kimi-K3-style models, on one device or many (torchrun).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prepare = sub.add_parser("prepare", help="tokenize a corpus into a dataset folder")
    prepare.add_argument("inputs", nargs="*", metavar="INPUT",
                         help=".txt/.md, .jsonl[.gz|.zst], .parquet files or folders of them "
                         "(none: the built-in corpus)")
    prepare.add_argument("--out", required=True, type=Path, help="dataset folder to create")
    prepare.add_argument("--val-fraction", type=float, default=0.05,
                         help="every round(1/F)-th document is validation (default 0.05)")
    prepare.add_argument("--tokenizer", default="bytes", metavar="bytes|PATH",
                         help="bytes (default) or a tokenizers tokenizer.json")
    prepare.add_argument("--train-tokenizer", type=_positive_int, metavar="VOCAB_SIZE",
                         help="train a byte-level BPE of this size on the inputs")
    prepare.add_argument("--tokenizer-sample", type=float, metavar="MB",
                         help="train the tokenizer on the first MB of text (default: all)")
    prepare.add_argument("--text-field", default="text",
                         help="the text field of JSONL records / Parquet rows (default text)")
    prepare.add_argument("--eod-token", metavar="TOKEN",
                         help="end-of-document token of --tokenizer (default: a known name)")
    prepare.add_argument("--workers", type=_positive_int, metavar="N",
                         help="tokenizer processes (default: all cores)")
    prepare.add_argument("--shard-tokens", type=_positive_int, metavar="N",
                         help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS})")
    order = prepare.add_mutually_exclusive_group()
    order.add_argument("--shuffle-seed", type=int, default=DEFAULT_SHUFFLE_SEED, metavar="N",
                       help="documents are shuffled with this seed before the validation "
                       f"split, the same for any --workers (default {DEFAULT_SHUFFLE_SEED})")
    order.add_argument("--no-shuffle", action="store_true",
                       help="keep the documents in input order")

    train = sub.add_parser("train", help="train a model, or continue one with --resume")
    train.add_argument("--run-dir", required=True, type=Path,
                       help="the run's folder: checkpoint, metrics.jsonl, run.json")
    train.add_argument("--data", type=Path, help="dataset folder (default: built-in corpus)")
    train.add_argument("--config", type=Path, help="TOML file: preset, [train], [model]")
    train.add_argument("--init-from", type=Path, metavar="DIR",
                       help="start a fresh run from the weights of a hub folder (k3-train "
                       "export's, or a Kimi Linear/K3 model's): continued pretraining; its "
                       "config.json is the model, so model flags may only set how it "
                       "computes (e.g. --kda-chunk-size)")
    train.add_argument("--resume", action="store_true",
                       help="continue from RUN_DIR's checkpoint (checkpoint.pt, or the "
                            "sharded checkpoint.dcp of FSDP2; strictly validated)")
    train.add_argument("--preset", choices=tuple(PRESETS), metavar="{" + ",".join(PRESETS) + "}",
                       help="model preset, the starting point of the model flags below "
                       "(default: tiny, or the config file's preset)")
    train.add_argument("--device", default="auto", help=DEVICE_HELP)
    train.add_argument("--report", action="store_true",
                       help="write RUN_DIR/report/ (plots + index.html) at the end")
    train.add_argument("--tensorboard", action="store_true",
                       help="also write TensorBoard scalars to RUN_DIR/tensorboard")
    train.add_argument("--profile-start", type=int, metavar="STEP",
                       help="trace attempts from this step with torch.profiler")
    train.add_argument("--profile-steps", type=int, default=3, metavar="N",
                       help="attempts in the trace window (default 3, at most 20)")
    train.add_argument("--allow-runtime-change", action="store_true",
                       help="with --resume: accept a checkpoint written under another torch "
                       "version, thread count or device (logged as runtime_changed; bitwise "
                       "continuation is then no longer promised)")
    train.add_argument("--parallel", choices=MODES, default="none",
                       help="data parallelism under torchrun: ddp (replicas) or fsdp "
                       "(FSDP2 shards); --batch-size is per process (default none)")
    train.add_argument("--nproc", type=_positive_int, metavar="N",
                       help="launch N processes with torchrun on this machine (needs "
                       "--parallel ddp|fsdp)")
    add_config_flags(train.add_argument_group(
        "training recipe (TrainConfig)",
        "Each flag overrides the config file's [train] value and, on resume, the run's "
        "recorded value."), TrainConfig, dest_prefix=TRAIN_FLAG)
    add_config_flags(train.add_argument_group(
        "model shape (K3Config)",
        "Each flag overrides the preset and the config file's [model] value; a resumed run "
        "keeps its model. Unless set, vocab_size grows to the data's tokenizer."),
        K3Config, dest_prefix=MODEL_FLAG, default_note=_preset_default)

    evaluate = sub.add_parser("eval", help="validation loss of a run's latest checkpoint "
                              "or of a hub folder")
    which = evaluate.add_mutually_exclusive_group(required=True)
    which.add_argument("--run-dir", type=Path, help="the run to evaluate")
    which.add_argument("--model", type=Path, metavar="DIR",
                       help="a hub folder to evaluate instead (k3-train export's; needs "
                       "--data prepared with its tokenizer)")
    evaluate.add_argument("--data", type=Path,
                          help="dataset folder (default: the one the run trained on)")
    evaluate.add_argument("--batches", type=_batches, metavar="N|all",
                          help="full validation batches from the start of the split "
                          "(default: the run's eval_batches; all: the whole split; more "
                          "than the split holds is clamped, with a note)")
    evaluate.add_argument("--device", default="auto", help=DEVICE_HELP)

    sample = sub.add_parser("sample", help="continue a prompt with a run's checkpoint or a "
                            "hub folder")
    source = sample.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=Path, help="the run to sample from")
    source.add_argument("--model", type=Path, metavar="DIR",
                        help="a hub folder with its tokenizer.json to sample from instead")
    sample.add_argument("--prompt", default="", help="text to continue (default: a new "
                        "document)")
    sample.add_argument("--max-new-tokens", type=_positive_int, default=200, metavar="N",
                        help="tokens to generate at most; the end-of-document token stops "
                        "earlier, and a prompt keeps only its last tokens that leave room for "
                        "them in the model's max_seq_len (default 200)")
    sample.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="0 = always the most likely token (default 0.8)")
    sample.add_argument("--top-k", type=_positive_int, metavar="K",
                        help="sample among the K most likely tokens only (default: all)")
    sample.add_argument("--top-p", type=_probability, metavar="P",
                        help="sample among the most likely tokens whose probability reaches "
                        "P (nucleus sampling; default: all)")
    sample.add_argument("--num-samples", type=_positive_int, default=1, metavar="N",
                        help="continuations of the prompt, drawn in one batch (default 1)")
    sample.add_argument("--seed", type=int, default=0, metavar="N",
                        help="the same seed gives the same text (default 0)")
    sample.add_argument("--device", default="auto", help=DEVICE_HELP)

    export = sub.add_parser("export", help="write a run's model as a Hugging Face hub "
                            "folder (transformers, vLLM, SGLang)")
    export.add_argument("--run-dir", required=True, type=Path, help="the run to export")
    export.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="the folder to write: config.json, model.safetensors, the "
                        "tokenizer, generation_config.json")
    export.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                        help="weights' dtype (default fp32; the decay parameters and router "
                        "bias stay fp32)")
    export.add_argument("--data", type=Path,
                        help="the run's dataset folder, for its tokenizer (default: the one "
                        "the run trained on)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out folder (atomically)")
    export.add_argument("--device", default="cpu", help="where the checkpoint is read "
                        "(default cpu)")

    inspect = sub.add_parser("inspect", help="summarize a checkpoint without loading it")
    inspect.add_argument("checkpoint", type=Path,
                         help="a checkpoint file, a sharded checkpoint folder or a run "
                         "directory")

    report = sub.add_parser("report", help="plot a run's metrics into RUN_DIR/report/")
    report.add_argument("--run-dir", required=True, type=Path, help="the run to plot")
    return parser


def _read_toml(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"preset", "train", "model"})
    if unknown:
        raise ConfigError(f"config file {path}: unknown key(s) {', '.join(unknown)}; "
                          "expected preset, [train], [model]")
    if not isinstance(data.get("preset", ""), str):
        raise ConfigError(f"config file {path}: preset must be a string, got "
                          f"{data['preset']!r}")
    for table in ("train", "model"):
        if not isinstance(data.get(table, {}), dict):
            raise ConfigError(f"config file {path}: {table} must be a table ([{table}]), got "
                              f"{data[table]!r}")
    return data


def _device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device: unknown device {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: k3-train trains on cpu or cuda only")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    return device


def _launch(nproc: int, argv: list[str]) -> int:
    """``k3-train train --nproc N``: rerun the same command under torchrun (without
    ``--nproc``); torchrun's status is this command's.

    Ctrl-C reaches torchrun and its ranks as well (one process group): the ranks stop at
    the next update boundary and save, so this process keeps waiting for them rather than
    dying of ``KeyboardInterrupt`` with a traceback while they still write, and exits 130
    as a one-process session does (torchrun itself reports the signal as a failure)."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            rest.append(arg)
    interrupted = False
    with subprocess.Popen(torchrun_command(nproc, rest)) as torchrun:
        while True:
            try:
                status = torchrun.wait()
                break
            except KeyboardInterrupt:
                interrupted = True
    return 128 + signal.SIGINT if interrupted and status else status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "train" and args.nproc is not None and not launched_by_torchrun():
        if args.parallel == "none":
            print("k3-train: error: --nproc needs --parallel ddp or --parallel fsdp",
                  file=sys.stderr)
            return 2
        return _launch(args.nproc, list(sys.argv[1:] if argv is None else argv))
    from k3_checkpoint import CheckpointError

    from .data import DataError
    from .interrupt import TrainingInterrupted
    from .runner import RunError
    from .threads import set_default_threads

    who = prog_name()
    # The process-wide CPU thread default is the command's only when it owns the process
    # (a console script or ``python -m``), never a program's that calls main(argv).
    thread_note = set_default_threads() if argv is None else None
    try:
        return _run(args, thread_note)
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
        print(f"{who}: interrupted; {_what_is_kept(args)}", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, thread_note: str | None = None) -> int:
    """The parsed command, run (this is where torch is imported)."""
    from . import runner
    from .data.options import PrepareOptions, default_workers
    from .sample import Sampling

    if args.command == "prepare":
        return runner.run_prepare(args.inputs, args.out, PrepareOptions(
            val_fraction=args.val_fraction, tokenizer=args.tokenizer,
            train_tokenizer=args.train_tokenizer, tokenizer_sample_mb=args.tokenizer_sample,
            text_field=args.text_field, eod_token=args.eod_token,
            workers=args.workers or default_workers(),
            shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS,
            shuffle_seed=None if args.no_shuffle else args.shuffle_seed))
    if args.command == "sample":
        try:
            sampling = Sampling(args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, seed=args.seed, top_p=args.top_p,
                                num_samples=args.num_samples)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return runner.run_sample(runner.SampleCommand(args.run_dir, sampling,
                                                      prompt=args.prompt,
                                                      device=_device(args.device),
                                                      model_dir=args.model))
    if args.command == "export":
        return runner.run_export(args.run_dir, args.out, data=args.data, dtype=args.dtype,
                                 device=_device(args.device), overwrite=args.overwrite)
    if args.command == "inspect":
        return runner.run_inspect(args.checkpoint)
    if args.command == "report":
        return runner.run_report(args.run_dir)
    if args.command == "eval":
        return runner.run_eval(args.run_dir, args.data, args.batches, _device(args.device),
                               model_dir=args.model)
    return runner.run_train(runner.TrainCommand(
        args.run_dir, data=args.data, toml=_read_toml(args.config), resume=args.resume,
        preset=args.preset, overrides=given(args, TRAIN_FLAG),
        model_overrides=given(args, MODEL_FLAG), device=_device(args.device),
        report=args.report, tensorboard=args.tensorboard, profile_start=args.profile_start,
        profile_steps=args.profile_steps, allow_runtime_change=args.allow_runtime_change,
        parallel=args.parallel, notes=(thread_note,) if thread_note else (),
        init_from=args.init_from))


def _what_is_kept(args: argparse.Namespace) -> str:
    """What an interrupted command leaves, without naming a checkpoint that does not exist."""
    if args.command != "train":
        return "nothing was changed"
    from .checkpoint import find_checkpoint

    if find_checkpoint(args.run_dir) is None:
        return "no checkpoint was written"
    return "the run's last checkpoint is intact; continue with --resume"


def _one_line(exc: OSError) -> str:
    return " ".join(str(exc).split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
