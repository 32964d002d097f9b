"""Decoding at its edges, each the case a mutation audit found untested: a left-padded
prefill in MLA's latent space, a cache that may not grow past the window, merged caches
(their longest sequence, a static cursor), prompts put back in order, top-k and top-p at
their boundaries, the documented stop-check period, and requests exactly at the window."""

from __future__ import annotations

import pytest
import torch
from test_decoding_state import _host_reads
from test_generate import TOLERANCE, _config, _model, _relative

from k3_model import Continuations, MLAttention
from k3_model.cache import DecodeCache
from k3_model.generate import pick, prefill
from k3_model.scoring import _batches


def test_a_left_padded_prefill_in_the_latent_space_equals_each_prompt_alone():
    """A padded query attends to itself (so its row is never empty): in the latent form a
    fully masked row is NaN, which the next MLA layer's cache would pass to every real
    query."""
    model = _model(_config("mla-rope"))
    for layer in model.modules():
        if isinstance(layer, MLAttention):
            layer.latent_steps = True
    assert sum(isinstance(m, MLAttention) for m in model.modules()) >= 2
    lengths = [3, 9]
    sequences = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
                 for n in lengths]
    ids = torch.zeros(2, 9, dtype=torch.long)
    real = torch.zeros(2, 9, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, 9 - len(seq):], real[row, 9 - len(seq):] = seq, True
    logits = model.forward_cached(ids, model.new_cache(), real)
    assert torch.isfinite(logits[real]).all()
    for row, seq in enumerate(sequences):
        with torch.no_grad():
            alone = model(seq[None])[0][0]
        assert _relative(logits[row, 9 - len(seq):], alone) < 5 * TOLERANCE


def test_a_growing_cache_stops_at_max_seq_len():
    model = _model(_config("tiny").replace(max_seq_len=24))
    x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache()
    model.forward_cached(x[:, :10], cache)
    for i in range(10, 24):
        model.forward_cached(x[:, i:i + 1], cache)
    assert cache.real is not None and cache.real.shape[1] == 24  # 10, 20, then 24, not 40
    buffers = [b for entry in cache.layers for b in getattr(entry, "buffers", []) if b is not None]
    assert buffers and all(b.shape[1] == 24 for b in buffers)


def test_a_merged_cache_checks_the_window_by_its_longest_sequence():
    model = _model(_config("tiny").replace(max_seq_len=10))
    cache, _ = prefill(model, [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]], torch.device("cpu"))
    assert cache.longest == 9
    model.forward_cached(torch.tensor([[1], [2]]), cache)  # 4 and 10 tokens
    with pytest.raises(ValueError, match="a sequence of 11 tokens exceeds"):
        model.forward_cached(torch.tensor([[1], [2]]), cache)


def test_merged_static_caches_continue_at_the_next_slot():
    """Prompts prefilled apart into static caches (CUDA graphs' shapes), merged: the next
    step writes the slot after the longest prompt and equals each sequence's forward."""
    model = _model(_config("tiny"))
    sequences = [torch.randint(0, 256, (n + 4,), generator=torch.Generator().manual_seed(n))
                 for n in (5, 11)]
    caches = []
    for seq, n in zip(sequences, (5, 11)):
        cache = model.new_cache(n + 4, static=True)
        model.forward_cached(seq[None, :n], cache)
        caches.append(cache)
    merged = DecodeCache.merge(caches)
    assert merged.static and int(merged.cursor) == 11  # type: ignore[arg-type]
    steps = [model.forward_cached(torch.stack([seq[n + j] for seq, n in
                                               zip(sequences, (5, 11))])[:, None], merged)
             for j in range(3)]
    for row, (seq, n) in enumerate(zip(sequences, (5, 11))):
        with torch.no_grad():
            alone = model(seq[None])[0][0]
        got = torch.cat([step[row] for step in steps])
        assert _relative(got, alone[n:n + 3]) < TOLERANCE, n


def test_prefill_gives_each_prompts_logits_in_the_prompts_order():
    """Prompts of a length prefilled together, another length between them: the logits
    are put back in the order the prompts came."""
    model = _model(_config("tiny"))
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5], [9, 8, 7]]
    _, last = prefill(model, prompts, torch.device("cpu"))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            alone = model(torch.tensor([prompt]))[0][0, -1]
        assert _relative(last[row], alone) < TOLERANCE, row


def _drawn(logits: torch.Tensor, **limits: float | int | None) -> set[int]:
    return {int(pick(logits, temperature=1.0, generator=torch.Generator().manual_seed(s),
                     **{"top_k": None, "top_p": None, **limits})[0]) for s in range(200)}


def test_top_k_draws_from_the_k_most_likely():
    logits = torch.tensor([[5.0, 4.9, 4.8, -9.0, -9.0]])
    assert _drawn(logits, top_k=2) == {0, 1}
    assert _drawn(logits, top_k=3) == {0, 1, 2}


def test_top_p_keeps_the_tokens_up_to_the_one_that_reaches_it():
    """Four equal tokens (probability 0.25 each, exact): the smallest set reaching 0.5 is
    two tokens; the third's more likely tokens already hold 0.5, so it is out."""
    logits = torch.zeros(1, 4)
    assert len(_drawn(logits, top_p=0.5)) == 2
    assert len(_drawn(logits, top_p=0.51)) == 3


def test_generation_checks_for_stops_every_8_steps_as_documented():
    """k3-model's README: one "has every sequence stopped?" read every 8 steps."""
    model = _model(_config("tiny"))
    calls: list[str] = []
    with _host_reads(calls):
        model.generate([[1, 2, 3], [4, 5]], 32, temperature=0, stop_ids=[999])
    assert calls.count("__bool__") == 3  # after steps 8, 16, 24 (the 32nd ends anyway)


def test_a_batch_whose_context_and_continuations_fill_the_window_exactly_is_one_prefill():
    requests = [Continuations([1] * 5, [[2]]), Continuations([6] * 2, [[7, 8, 9, 10]])]
    # together the longest context (5) and continuation (4) read 5 + 4 - 1 = 8 tokens
    assert len(_batches(requests, 8, 8)) == 1
    assert len(_batches(requests, 8, 7)) == 2  # each fits alone, not together


def test_a_prompt_and_its_new_tokens_may_fill_the_window_exactly():
    model = _model(_config("tiny").replace(max_seq_len=16))
    assert len(model.generate([[1] * 10], 6, temperature=0)[0]) == 6
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.generate([[1] * 10], 7, temperature=0)
