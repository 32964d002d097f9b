"""A run's model as a Hugging Face hub folder, and hub folders as models for the commands.

``k3-train export`` writes the run's weights with its model spec's hub format
(:class:`~k3_trainer.models.HubFormat`) plus what a user of transformers expects beside
them: the tokenizer (``tokenizer.json``, the run's own BPE or, for a byte-level run, an
equivalent byte-level file) with its
``tokenizer_config.json``, and ``generation_config.json`` whose eos is the run's
end-of-document token. ``train --init-from``, ``eval --model`` and ``sample --model``
read such folders back; the tokenizer a folder ships is checked against the data's.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ConfigError
from .data import Codec, document_start
from .data.tokenizer import (
    BYTES_EOD,
    TOKENIZER_FILE,
    BytesCodec,
    HFCodec,
    byte_decoder,
    require_tokenizers,
)
from .json_file import read_json_object
from .models import HubFolderError, ModelSpec, spec_for_model_type

TOKENIZER_CONFIG = "tokenizer_config.json"
BYTE_EOD_NAME = "<|endoftext|>"
"""The name the byte-level tokenizer file gives byte 0xFF, the byte runs' end of document."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

DOCUMENT_MASKING = "document_masking"
"""The ``config.json`` field an export of a run trained with ``document_masking`` carries
(true), so that ``eval --model`` reads the folder's validation data the same way."""


@cache
def byte_tokenizer_json() -> str:
    """A ``tokenizers`` file that encodes text exactly as :class:`BytesCodec` does (id =
    UTF-8 byte, byte-level pre-tokenization, no merges), with id 0xFF, which never occurs
    in UTF-8 text, as the special end-of-document token."""
    tk = require_tokenizers()
    chars = {byte: char for char, byte in byte_decoder().items()}
    vocab = {chars[b]: b for b in range(256) if b != BYTES_EOD}
    vocab[BYTE_EOD_NAME] = BYTES_EOD
    tokenizer = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                          use_regex=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    tokenizer.add_special_tokens([tk.AddedToken(BYTE_EOD_NAME, special=True)])
    return str(tokenizer.to_str())


def _tokenizer_json(codec: Codec) -> str:
    return codec.json_text if isinstance(codec, HFCodec) else byte_tokenizer_json()


def _starting_documents(json_text: str, token: str, token_id: int) -> str:
    """``json_text`` with a post-processor that puts ``token`` in front of every encoded
    text (``tokenizer(text)`` with special tokens, transformers' default), the document
    start :func:`~k3_trainer.data.document_start` feeds the model."""
    tk = require_tokenizers()
    tokenizer = tk.Tokenizer.from_str(json_text)
    tokenizer.post_processor = tk.processors.TemplateProcessing(
        single=f"{token} $A", pair=f"{token} $A {token} $B:1",
        special_tokens=[(token, token_id)])
    return str(tokenizer.to_str())


def tokenizer_files(codec: Codec, max_length: int) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for the run's tokenizer: a text
    begins as the model's documents do (:func:`~k3_trainer.data.document_start`, the
    end-of-document token, which is also the config's ``bos_token``)."""
    name = codec.eod_token if isinstance(codec, HFCodec) else BYTE_EOD_NAME
    start = document_start(codec)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name,
              "eos_token": name, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    return {TOKENIZER_FILE: _starting_documents(_tokenizer_json(codec), name, start),
            TOKENIZER_CONFIG: json.dumps(config, indent=2) + "\n"}


def _hub_of(spec: ModelSpec, what: str) -> Any:
    if spec.hub is None:
        raise ConfigError(f"{what}: the model {spec.name!r} has no hub format")
    return spec.hub


def export_model(model: nn.Module, spec: ModelSpec, codec: Codec, out: Path, *,
                 max_seq_len: int, dtype: str = "fp32", overwrite: bool = False,
                 document_masking: bool = False) -> Path:
    """Write ``model`` with the run's tokenizer into the hub folder ``out``: a new or empty
    folder, or (``overwrite``) a previous export, replaced once the new one is complete.
    Any other ``out`` is refused in one line naming what it holds. A model trained with
    ``document_masking`` says so in its ``config.json`` (:data:`DOCUMENT_MASKING`)."""
    hub = _hub_of(spec, "export")
    trained = {"config_fields": {DOCUMENT_MASKING: True}} if document_masking else {}
    try:
        written: Path = hub.save(model, out, dtype=DTYPES[dtype], bos_token_id=codec.eod_id,
                                 eos_token_id=codec.eod_id,
                                 extra_files=tokenizer_files(codec, max_seq_len),
                                 overwrite=overwrite, **trained)
        return written
    except HubFolderError as exc:
        raise ConfigError(f"export: {exc}") from None
    except FileExistsError as exc:
        raise ConfigError(out_refusal(out, exc)) from None


def out_refusal(out: Path, exc: FileExistsError) -> str:
    """The line that refuses ``--out``: what the folder holds and what ``--overwrite``
    would (or would not) replace. A hub format's refusal says so by its ``reason`` (why
    the folder is not a previous export; None: it is one) and ``entries`` (what it holds),
    as k3-model's :class:`~k3_model.hub.files.FolderInUse` does."""
    if not hasattr(exc, "reason"):
        return f"--out {exc}"
    reason: str | None = getattr(exc, "reason", None)
    entries: tuple[str, ...] = tuple(getattr(exc, "entries", ()))
    if reason is None:
        shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more"
                                          if len(entries) > 4 else "")
        return (f"--out {out} already exists: a previous export ({len(entries)} files: "
                f"{shown}); --overwrite replaces it (those files, once the new export is "
                "complete), or choose another --out")
    return (f"--out {out} already exists and {reason}; choose another --out or move it "
            "aside yourself (--overwrite replaces only a previous export: a folder of the "
            "files export writes and nothing else)")


def folder_spec(folder: Path, flag: str = "--model") -> ModelSpec:
    """The model spec whose hub format reads ``folder`` (by its config.json's model_type)."""
    data = folder_config(folder, flag)
    model_type = data.get("model_type")
    try:
        return spec_for_model_type(model_type)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {folder}: {exc}") from None


def folder_config(folder: Path, flag: str = "--model") -> dict[str, Any]:
    """A hub folder's ``config.json``."""
    return read_json_object(folder / "config.json", ConfigError,
                            what=f"{flag} {folder}/config.json",
                            missing=f"{flag} {folder}: no config.json; not a hub model folder")


def trained_with_document_masking(folder: Path) -> bool:
    """Whether the hub folder's model was trained with documents kept apart (its
    ``config.json`` says so: ``"document_masking": true``)."""
    return folder_config(folder).get(DOCUMENT_MASKING) is True


def _tokenizer_text(folder: Path) -> str | None:
    path = folder / TOKENIZER_FILE
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} cannot be read: {exc}") from None


def _same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer files encode text to the same ids: equal but for the
    post-processor (an export adds the document start there; ids of the text itself, as
    prepare encodes it, do not depend on it)."""
    try:
        left, right = json.loads(a), json.loads(b)
    except json.JSONDecodeError:
        return a == b
    if isinstance(left, dict) and isinstance(right, dict):
        left, right = ({k: v for k, v in side.items() if k != "post_processor"}
                       for side in (left, right))
    return bool(left == right)


def folder_codec(folder: Path, spec: ModelSpec) -> Codec:
    """The tokenizer a hub folder ships (``BytesCodec`` for the byte-level file export
    writes), with the folder's eos as end of document."""
    text = _tokenizer_text(folder)
    if text is None:
        raise ConfigError(f"{folder} has no {TOKENIZER_FILE}: sampling needs the model's "
                          "tokenizer beside it")
    if _same_tokenizer(text, byte_tokenizer_json()):
        return BytesCodec()
    eos = _folder_token_ids(folder, spec).get("eos_token_id")
    name = None
    if eos is not None:  # the folder's eos is the end of document, whatever its name
        try:
            name = require_tokenizers().Tokenizer.from_str(text).id_to_token(eos)
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise ConfigError(f"{folder / TOKENIZER_FILE} is not a tokenizers file: {exc}"
                              ) from None
        if name is None:
            raise ConfigError(f"{folder}: eos_token_id {eos} is not in its {TOKENIZER_FILE}")
    return HFCodec(text, name, source=str(folder / TOKENIZER_FILE))


def _folder_token_ids(folder: Path, spec: ModelSpec) -> dict[str, int | None]:
    generation = folder / "generation_config.json"
    ids: dict[str, int | None] = {}
    try:
        ids = dict(_hub_of(spec, str(folder)).token_ids(folder))
    except HubFolderError as exc:
        raise ConfigError(f"{folder}: {exc}") from None
    if generation.is_file():
        eos = read_json_object(generation, ConfigError).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int):
            ids["eos_token_id"] = eos
    return ids


def check_tokenizer(folder: Path, codec: Codec, data_dir: Path, flag: str) -> str | None:
    """Refuse data made with another tokenizer than the one ``folder`` ships; a note when
    the folder ships none (nothing to compare)."""
    text = _tokenizer_text(folder)
    if text is None:
        return (f"{flag} {folder} ships no {TOKENIZER_FILE}; make sure {data_dir} was "
                "prepared with the model's tokenizer")
    if not _same_tokenizer(text, _tokenizer_json(codec)):
        raise ConfigError(f"{flag} {folder}: its {TOKENIZER_FILE} is not the tokenizer "
                          f"{data_dir} was prepared with; the model only reads its own "
                          "tokenizer's ids (prepare the data with --tokenizer "
                          f"{folder / TOKENIZER_FILE})")
    return None


def load_folder(folder: Path, device: torch.device) -> tuple[ModelSpec, nn.Module]:
    """A hub folder's spec and model on ``device`` (fp32 parameters), for eval and sample."""
    spec = folder_spec(folder)
    try:
        model = _hub_of(spec, f"--model {folder}").load(folder, torch.float32)
    except HubFolderError as exc:
        raise ConfigError(f"--model {exc}") from None
    return spec, model.to(device)
