"""The decoding state written in place, MLA attending in its latent space, a static cache
for CUDA graphs, forks of a cache, and decoding that leaves the tokens on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from test_generate import TOLERANCE, _config, _model, _relative

from k3_model import K3Model, MLAttention
from k3_model.cache import DecodeCache, KDAState
from k3_model.generate import STOP_CHECK_EVERY


def _tensors(cache: DecodeCache) -> list[torch.Tensor]:
    """Every tensor the cache holds."""
    found: list[torch.Tensor] = [cache.real, cache.lengths]  # type: ignore[list-item]
    for entry in cache.layers:
        if isinstance(entry, KDAState):
            found += [entry.state, entry.tail]  # type: ignore[list-item]
        else:
            found += [b for b in entry.buffers if b is not None]
    return found


def _decode(model: K3Model, cache: DecodeCache, x: torch.Tensor, start: int, stop: int,
            width: int = 1) -> list[torch.Tensor]:
    return [model.forward_cached(x[:, i:i + width], cache) for i in range(start, stop, width)]


@pytest.mark.parametrize("name", ["tiny", "gqa", "mla-rope"])
def test_a_reserved_cache_is_written_in_place_and_refuses_to_overflow(name):
    model = _model(_config(name))
    x = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(capacity=30)
    model.forward_cached(x[:, :20], cache)
    before = [(t.data_ptr(), t.shape) for t in _tensors(cache)]
    _decode(model, cache, x, 20, 30)
    assert [(t.data_ptr(), t.shape) for t in _tensors(cache)] == before
    with pytest.raises(ValueError, match="exceed the capacity it was made with"):
        model.forward_cached(x[:, :1], cache)


def test_an_unreserved_cache_grows_by_doubling():
    model = _model(_config("tiny"))
    x = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache()
    model.forward_cached(x[:, :10], cache)
    lengths = set()
    for i in range(10, 100):
        model.forward_cached(x[:, i:i + 1], cache)
        lengths.add(int(cache.real.shape[1]))  # type: ignore[union-attr]
    assert lengths == {20, 40, 80, 160}


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-tiny", "mla-rope", "base"])
def test_latent_space_attention_equals_the_expanded_form_and_the_full_forward(name):
    """NoPE gated MLA (K3), NoPE MLA (Kimi Linear), MLA with RoPE, a low-rank query."""
    model = _model(_config(name))
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(x)[0]
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    got = {}
    for latent in (True, False):
        for layer in layers:
            layer.latent_steps = latent
        cache = model.new_cache(40)
        parts = [model.forward_cached(x[:, :25], cache), *_decode(model, cache, x, 25, 31),
                 *_decode(model, cache, x, 31, 40, width=3)]
        got[latent] = torch.cat(parts, dim=1)[:, 25:]
        assert _relative(got[latent], full[:, 25:]) < TOLERANCE, latent
    for layer in layers:
        layer.latent_steps = None
    assert _relative(got[True], got[False]) < TOLERANCE
    # by cost: a decoding step attends in the latent space, a long prefill expanded
    assert layers[0].attends_in_latent_space(1) and not layers[0].attends_in_latent_space(512)


@pytest.mark.parametrize("name", ["tiny", "gqa", "mla-rope"])
def test_a_static_cache_attends_over_its_whole_buffer_with_the_same_logits(name):
    """Static shapes for CUDA graphs: unwritten positions are masked, slots found on the
    device; the result is the full forward's."""
    model = _model(_config(name))
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(x)[0]
    cache = model.new_cache(capacity=64, static=True)
    parts = [model.forward_cached(x[:, :30], cache), *_decode(model, cache, x, 30, 48)]
    assert _relative(torch.cat(parts, dim=1), full) < TOLERANCE
    assert int(cache.cursor) == 48  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a capacity"):
        model.new_cache(static=True)


def test_forks_decode_on_their_own():
    model = _model(_config("tiny"))
    x = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(40)
    model.forward_cached(x[:, :30], cache)
    fork = cache.clone()
    _decode(model, fork, y, 0, 10)  # the fork goes elsewhere …
    steps = torch.cat(_decode(model, cache, x, 30, 40), dim=1)  # … the original is intact
    with torch.no_grad():
        full = model(x)[0]
    assert _relative(steps, full[:, 30:]) < TOLERANCE
    # expand: each row k times in a row; select: any rows, repeats allowed
    base = model.new_cache(40)
    model.forward_cached(x[:, :30], base)
    three = base.expand(3)
    assert three.batch == 6 and three.length == base.length
    out = model.forward_cached(x[:, 30:31].repeat_interleave(3, dim=0), three)
    assert _relative(out, full[:, 30:31].repeat_interleave(3, dim=0)) < TOLERANCE
    picked = base.select(torch.tensor([1, 1, 0]))
    out = model.forward_cached(x[[1, 1, 0], 30:31], picked)
    assert _relative(out, full[[1, 1, 0], 30:31]) < TOLERANCE
    with pytest.raises(ValueError, match="k must be"):
        base.expand(0)


_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def _host_reads(calls: list[str]) -> Iterator[None]:
    """Record the Python-level calls that copy a tensor's value to the host (on a GPU,
    each waits for the device)."""
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name: str):
        def read(self, *args, **kwargs):
            calls.append(name)
            return originals[name](self, *args, **kwargs)
        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, counted(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("name", ["tiny", "base", "gqa"])
def test_a_decoding_step_reads_nothing_back_to_the_host(name):
    model = _model(_config(name))
    x = torch.randint(0, 256, (3, 30), generator=torch.Generator().manual_seed(7))
    for static in (False, True):
        cache = model.new_cache(30, static=static)
        model.forward_cached(x[:, :20], cache)
        calls: list[str] = []
        with _host_reads(calls):
            _decode(model, cache, x, 20, 30)
        assert calls == [], static


def test_generation_reads_the_tokens_once_plus_a_stop_check_every_few_steps():
    model = _model(_config("tiny"))
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    calls: list[str] = []
    steps = 4 * STOP_CHECK_EVERY
    with _host_reads(calls):
        model.generate(prompts, steps, temperature=0.8, top_k=20, top_p=0.9, stop_ids=[255])
    prefill_reads = 2  # grouping the prompts by length: the merge and the reorder
    assert len(calls) <= prefill_reads + steps // STOP_CHECK_EVERY + 1, calls
    calls.clear()
    with _host_reads(calls):  # no stop ids: nothing to check, the tokens read once
        model.generate(prompts, steps, temperature=0)
    assert len(calls) <= prefill_reads + 1, calls
    # streaming reads the tokens once per step, nothing more
    calls.clear()
    with _host_reads(calls):
        model.generate(prompts, steps, temperature=0.8, on_token=lambda i, t: None)
    assert calls.count("tolist") <= steps + 1 and len(calls) <= prefill_reads + steps + 1


def test_a_batch_that_has_stopped_decodes_at_most_a_stop_check_more():
    model = _model(_config("tiny"))
    free = model.generate([[1, 2, 3]], 40, temperature=0)
    stop = free[0][2]
    forwards = []
    original = model.forward_cached

    def counting(*args, **kwargs):
        forwards.append(1)
        return original(*args, **kwargs)

    model.forward_cached = counting  # type: ignore[method-assign]
    got = model.generate([[1, 2, 3]], 40, temperature=0, stop_ids=[stop])
    assert got == [free[0][:free[0].index(stop) + 1]]
    assert len(forwards) <= 1 + len(got[0]) + STOP_CHECK_EVERY
