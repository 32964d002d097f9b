"""An lm-evaluation-harness backend for K3 Train models, registered as ``k3``.

lm-eval finds models by name in its registry, with no plugin discovery, so the backend
registers itself when this module is imported::

    import k3_trainer.lm_eval  # noqa: F401  (registers "k3")
    import lm_eval
    lm_eval.simple_evaluate(model="k3", model_args="pretrained=runs/r1", tasks=["hellaswag"])

lm-eval fills its registry with its own backends lazily, only while the registry is empty;
registering first would hide them ("no model for this name found! Supported model names:
k3"), so this module imports ``lm_eval.models`` (whose import registers lm-eval's own
backends) before it adds ``k3``: ``hf`` and ``k3`` then run side by side in one process.

``python -m k3_trainer.lm_eval ARGS`` is lm-eval's own command line (``lm-eval ARGS``,
every flag of it) with ``k3`` registered: ``python -m k3_trainer.lm_eval --model k3
--model_args pretrained=runs/r1 --tasks hellaswag``. lm-eval's default device is
``cuda:0``; on a machine without CUDA the backend says so once and runs on the CPU.

``pretrained`` is a ``k3-train`` run directory (its latest checkpoint, or ``step=N``'s) or
a hub folder (``k3-train export``'s). Texts begin with the document start
(:func:`~k3_trainer.data.document_start`), as training saw documents, and are encoded as
lm-eval's own ``hf`` backend encodes them (a context alone; context + continuation whole,
split at the context's length).

- ``loglikelihood``: the model's ``score_continuations`` (each distinct context once,
  its decoding state forked for the continuations), the same scoring as
  ``k3-train eval --tasks``.
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_seq_len`` tokens,
  each window one scored continuation.
- ``generate_until``: the model's stateful ``generate``, cut at the first stop string.

lm-eval (``pip install lm-eval==0.4.13``) is an optional extra of k3-trainer, never a
dependency of the core packages. It opens run directories and hub folders through
:mod:`k3_trainer.session`, as the commands do.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("k3_trainer.lm_eval needs lm-evaluation-harness: "
                      "pip install 'k3-trainer[lm-eval]' (lm-eval==0.4.13)") from exc

from .config import ConfigError
from .data import Codec, document_start
from .record import RUN_RECORD
from .session import open_model, parse_device
from .tasks.scoring import check_vocabulary, encode_choice, fit_window, score_pairs


def load_model(pretrained: str | Path, step: int | None, device: torch.device
               ) -> tuple[Any, Codec]:
    """The model and its tokenizer from a run directory or a hub folder."""
    path = Path(pretrained)
    if (path / RUN_RECORD).is_file():
        opened = open_model(path, None, step, device)
    elif (path / "config.json").is_file():
        if step is not None:
            raise ConfigError("step picks a checkpoint of a run directory, not of a hub folder")
        opened = open_model(None, path, None, device)
    else:
        raise ConfigError(f"{pretrained} is neither a k3-train run directory ({RUN_RECORD}) nor "
                          "a hub folder (config.json)")
    return opened.model, opened.codec


def backend_device(device: str | None) -> torch.device:
    """The device the backend scores on: ``device`` (``auto``/None: CUDA when there is
    one), or the CPU, with a note, when it names CUDA on a machine without (lm-eval's
    own default is ``cuda:0``)."""
    name = device or "auto"
    if name.startswith("cuda") and not torch.cuda.is_available():
        print(f"k3: note: no CUDA device here; scoring on the CPU (device {name} asked)",
              file=sys.stderr)
        name = "cpu"
    return parse_device(name)


class K3LM(LM):  # type: ignore[misc]
    """``K3LM(pretrained=PATH, step=None, batch_size=8, device="auto")``."""

    def __init__(self, pretrained: str, step: int | str | None = None,
                 batch_size: int | str | None = 8, device: str | None = "auto",
                 max_batch_size: int | None = None, **_: Any) -> None:
        super().__init__()
        self.torch_device = backend_device(device)
        self.model, self.codec = load_model(pretrained, None if step in (None, "") else
                                            int(step), self.torch_device)
        self.model.eval()
        config: Any = getattr(self.model, "config", None)
        self.max_length = int(config.max_seq_len)
        self.vocab_size = int(config.vocab_size)
        # lm-eval passes "auto" or a number as text; the scoring batches contexts itself
        self.batch_size = int(str(batch_size)) if str(batch_size).isdigit() else 8
        self.start = document_start(self.codec)
        for method in ("score_continuations", "generate"):
            if not callable(getattr(self.model, method, None)):
                raise ConfigError(f"{pretrained}: its model has no {method}(); the k3 backend "
                                  "scores and generates with the model's decoding state")

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.codec.encode_batch([text])[0]] if text else []

    # --- lm-eval's three request types ------------------------------------------------------

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        return self._score([encode_choice(self.codec, request.args[0], request.args[1],
                                          self.start) for request in requests])

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        out = []
        for request in requests:
            (text,) = request.args[:1]
            tokens = self._encode(text)
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=tokens, prefix_token=self.start, max_seq_len=self.max_length,
                context_len=1)]
            scored = self._score([(list(c), list(k)) for c, k in windows]) if tokens else []
            out.append(sum(loglik for loglik, _ in scored))
        return out

    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, options = request.args
            options = dict(options or {})
            until = options.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(options.pop("max_gen_toks", 256))
            sample = bool(options.pop("do_sample", False))
            temperature = float(options.pop("temperature", 0.0)) if sample else 0.0
            new = max(1, min(new, self.max_length - 1))
            ids = fit_window([self.start, *self._encode(context)], new, self.max_length)
            tokens = self.model.generate([ids], new, temperature=temperature,
                                         stop_ids=(self.codec.eod_id,))[0]
            text = self.codec.decode(tokens)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
        return out

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each (context, continuation): its log-likelihood and whether it is greedy."""
        check_vocabulary(pairs, self.vocab_size, "an lm-eval request")
        return [(s.loglik, s.greedy)
                for s in score_pairs(self.model, pairs, max_len=self.max_length,
                                     batch_size=self.batch_size)]


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's own command line (``lm-eval ARGS``) with ``k3`` registered: ``argv``
    (default: this process's arguments) as lm-eval's."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":  # python -m k3_trainer.lm_eval: register from the module itself
    importlib.import_module("k3_trainer.lm_eval").main()
else:
    importlib.import_module("lm_eval.models")  # lm-eval's own backends first (see above)
    register_model("k3")(K3LM)


__all__ = ["K3LM", "backend_device", "load_model", "main"]
