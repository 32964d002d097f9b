"""``k3-train sample``: continue a prompt with a run's checkpoint or a hub folder."""

from __future__ import annotations

import sys

from ..config import ConfigError
from ..data import Codec
from ..sample import Sampling, TextStream, context_room, sample_text
from ..session import open_model, parse_device
from .options import SampleCommand


def run(command: SampleCommand, notes: tuple[str, ...] = ()) -> int:
    """Print the prompt and its continuations from the run's checkpoint (strictly loaded)
    or from a hub folder with its own tokenizer."""
    try:
        sampling = Sampling(command.max_new_tokens, temperature=command.temperature,
                            top_k=command.top_k, seed=command.seed, top_p=command.top_p,
                            num_samples=command.num_samples)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    device = parse_device(command.device)
    opened = open_model(command.run_dir, command.model, command.step, device)
    model, codec, max_seq_len = opened.model, opened.codec, opened.max_seq_len
    if max_seq_len is None:
        raise ConfigError(f"--model {command.model}: its model declares no max_seq_len")
    if callable(getattr(model, "generate", None)):
        _note_room(codec, command.prompt, sampling.max_new_tokens, max_seq_len)
    many = sampling.num_samples > 1
    stream = TextStream(codec) if sys.stdout.isatty() and not many else None
    if stream is not None:  # a terminal: the text as it is produced
        print(command.prompt, end="", flush=True)
    timings: dict[str, float] = {}
    texts = sample_text(model, codec, command.prompt, sampling, max_seq_len=max_seq_len,
                        device=device, stream=stream, timings=timings)
    for number, text in enumerate(texts, 1):
        if stream is not None:
            print(text[len(command.prompt) + stream.shown:])  # what was held back, if any
            continue
        if many:
            print(f"--- sample {number} of {len(texts)} ---")
        print(text)
    _say_speed(timings)
    return 0


def _note_room(codec: Codec, prompt: str, max_new_tokens: int, max_seq_len: int) -> None:
    """Say in one line what decoding with the cache leaves out (:func:`context_room`): the
    prompt and the new tokens must fit in ``max_seq_len`` together."""
    length = 1 + (len(codec.encode_batch([prompt])[0]) if prompt else 0)
    kept, new_tokens = context_room(length, max_new_tokens, max_seq_len)
    if kept < length:
        print(f"k3-train: note: the prompt is {length} tokens; its last {kept} are read, "
              f"leaving room for {new_tokens} new ones in max_seq_len {max_seq_len}",
              file=sys.stderr)
    elif new_tokens < max_new_tokens:
        print(f"k3-train: note: --max-new-tokens {max_new_tokens} does not fit after the "
              f"{length}-token prompt in the model's max_seq_len {max_seq_len}; generating "
              f"at most {new_tokens}", file=sys.stderr)


def _say_speed(timings: dict[str, float]) -> None:
    """One line on stderr: new tokens over the decoding time (the prompt's prefill apart)."""
    new, seconds = int(timings.get("new_tokens", 0)), timings.get("decode_s", 0.0)
    if new and seconds > 0:
        prefill = timings.get("prefill_s")
        after = "" if prefill is None else f" after a {prefill:.2f} s prefill"
        print(f"k3-train: {new} new tokens in {seconds:.2f} s: {new / seconds:,.1f} "
              f"tokens/s{after}", file=sys.stderr)
