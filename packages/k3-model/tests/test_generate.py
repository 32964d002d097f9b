"""Cached decoding equals the full forward, position by position, and ``generate`` on top
of it: batched prompts of different lengths, seeded draws, per-sequence stops."""

from __future__ import annotations

import pytest
import torch

from k3_model import K3Config, K3Model, preset
from k3_model.cache import KDAState, LatentCache, cache_bytes_formula
from k3_model.generate import prefill

TOLERANCE = 1e-5  # max |cached − full| / max |full|, fp32


def _config(name: str) -> K3Config:
    """Every preset's kinds of layer at a size a CPU test builds in a second."""
    cpu = dict(kda_backend="torch", vocab_size=256, max_seq_len=512)
    shrink = {
        "small": dict(n_layers=4),
        "base": dict(n_layers=4, n_experts=8, moe_top_k=2, loss_chunk_size=0),
        "gqa": None, "mla-rope": None,
    }.get(name, {})
    if name == "gqa":  # the comparison layouts: RoPE per position, a KV cache
        return K3Config(attention="gqa", n_kv_heads=2, d_model=64, n_heads=4, **cpu)
    if name == "mla-rope":
        return K3Config(attention="mla", d_model=64, n_heads=4, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, q_lora_rank=24,
                        **cpu)
    return preset(name, **cpu, **(shrink or {}))


def _model(config: K3Config, seed: int = 0) -> K3Model:
    torch.manual_seed(seed)
    model = K3Model(config).eval()
    with torch.no_grad():  # non-zero reads and router bias (zero at init), as trained
        for module in model.modules():
            if isinstance(getattr(module, "query", None), torch.nn.Parameter):
                module.query.normal_(0.0, 0.05)
        for layer in model.moe_layers().values():
            layer.balancer.bias.normal_(0.0, 0.02)
    return model


def _relative(got: torch.Tensor, full: torch.Tensor) -> float:
    return float((got - full).abs().max() / full.abs().max())


PRESETS = ["tiny", "small", "base", "kimi-linear-tiny", "gqa", "mla-rope"]


@pytest.fixture(scope="module", params=PRESETS)
def model(request) -> K3Model:
    return _model(_config(request.param))


def test_prefill_then_single_and_multi_token_steps_equal_the_full_forward(model):
    chunk = model.config.kda_chunk_size
    generator = torch.Generator().manual_seed(4)
    for prompt in (1, chunk - 1, chunk, chunk + 1, 2 * chunk + chunk // 2):
        x = torch.randint(0, 256, (2, prompt + 6), generator=generator)
        with torch.no_grad():
            full = model(x)[0]
        cache = model.new_cache()
        parts = [model.forward_cached(x[:, :prompt], cache)]
        for i in range(prompt, prompt + 3):  # one token at a time
            parts.append(model.forward_cached(x[:, i:i + 1], cache))
        parts.append(model.forward_cached(x[:, prompt + 3:], cache))  # then three at once
        assert _relative(torch.cat(parts, dim=1), full) < TOLERANCE, prompt


def _unequal(model: K3Model) -> tuple[list[int], list[torch.Tensor]]:
    chunk = model.config.kda_chunk_size
    lengths = [1, chunk + 1, 2 * chunk + 3]
    generator = torch.Generator().manual_seed(5)
    return lengths, [torch.randint(0, 256, (n + 4,), generator=generator) for n in lengths]


def _decode_after(model: K3Model, cache, lengths, sequences) -> list[torch.Tensor]:
    return [model.forward_cached(torch.stack([s[n + j] for s, n in zip(sequences, lengths)])
                                 [:, None], cache) for j in range(4)]


def test_a_batch_of_unequal_prompts_decodes_each_as_if_alone(model):
    """generate's path: each prompt length prefilled apart, the caches merged (padded)."""
    lengths, sequences = _unequal(model)
    cache, last = prefill(model, [s[:n].tolist() for s, n in zip(sequences, lengths)],
                          torch.device("cpu"))
    steps = _decode_after(model, cache, lengths, sequences)
    for row, (seq, n) in enumerate(zip(sequences, lengths)):
        with torch.no_grad():
            alone = model(seq[None])[0][0]
        got = torch.stack([last[row], *(s[row, 0] for s in steps)])
        assert _relative(got, alone[n - 1:]) < TOLERANCE, n


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-tiny", "mla-rope"])
def test_a_left_padded_prefill_equals_up_to_rounding(name):
    """One padded forward for all prompts: KDA's chunks then start at other tokens, so the
    sums round differently (observed up to ~1.4e-5 relative in fp32), nothing more."""
    model = _model(_config(name))
    lengths, sequences = _unequal(model)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    real = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, (seq, n) in enumerate(zip(sequences, lengths)):
        ids[row, width - n:], real[row, width - n:] = seq[:n], True
    cache = model.new_cache()
    first = model.forward_cached(ids, cache, real)
    steps = _decode_after(model, cache, lengths, sequences)
    for row, (seq, n) in enumerate(zip(sequences, lengths)):
        with torch.no_grad():
            alone = model(seq[None])[0][0]
        got = torch.cat([first[row, width - n:], *(s[row] for s in steps)])
        assert _relative(got, alone) < 5 * TOLERANCE, n


def _greedy_by_recomputing(model: K3Model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[0][:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_greedy_generation_equals_recomputing_the_prefix(model):
    """Every preset's layer kinds; one batch of prompts of 1, C − 1, C, C + 1 and 2.5·C
    tokens (C: KDA's chunk), which prefill apart and decode together."""
    chunk = model.config.kda_chunk_size
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist()
               for n in (1, chunk - 1, chunk, chunk + 1, 2 * chunk + chunk // 2)]
    got = model.generate(prompts, 8, temperature=0)
    assert got == [_greedy_by_recomputing(model, p, 8) for p in prompts]


def test_each_sequence_stops_on_its_own_and_includes_its_stop_token():
    model = _model(_config("kimi-linear-tiny"))
    prompts = [[10, 11], [12, 13, 14, 15]]
    free = model.generate(prompts, 16, temperature=0)
    stop = free[0][4]  # a token the first sequence produces
    stopped = model.generate(prompts, 16, temperature=0, stop_ids=[stop])
    first = free[0].index(stop)
    assert stopped[0] == free[0][:first + 1]
    cut = free[1].index(stop) + 1 if stop in free[1] else len(free[1])
    assert stopped[1] == free[1][:cut]


def test_seeded_draws_are_reproducible_and_the_knobs_work():
    model = _model(_config("tiny"))
    prompts = [[1, 2, 3], [4, 5]]
    draw = model.generate(prompts, 20, temperature=1.0, seed=3)
    assert model.generate(prompts, 20, temperature=1.0, seed=3) == draw
    assert model.generate(prompts, 20, temperature=1.0, seed=4) != draw
    greedy = model.generate(prompts, 20, temperature=0)
    assert model.generate(prompts, 20, temperature=1.0, top_k=1, seed=9) == greedy
    assert model.generate(prompts, 20, temperature=1.0, top_p=1e-6, seed=9) == greedy
    streamed: list[tuple[int, int]] = []
    got = model.generate(prompts, 5, temperature=0, on_token=lambda i, t: streamed.append((i, t)))
    assert sorted(streamed) == sorted((i, t) for i, row in enumerate(got) for t in row)


def test_a_stop_id_in_every_row_ends_each_row_there():
    model = _model(_config("tiny"))
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    free = model.generate(prompts, 12, temperature=0)
    for stop_at in (2, 5):
        stops = {row[stop_at] for row in free}  # a token of every row, the last one's too
        got = model.generate(prompts, 12, temperature=0, stop_ids=stops)
        for row, (ours, full) in enumerate(zip(got, free)):
            first = next(i for i, t in enumerate(full) if t in stops)
            assert ours == full[:first + 1], row


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_a_draw_is_multinomial_of_the_softmax_at_the_temperature(temperature):
    from k3_model.generate import pick

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(8))
    drawn = pick(logits, temperature=temperature, top_k=None, top_p=None,
                 generator=torch.Generator().manual_seed(9))
    expected = torch.multinomial((logits / temperature).softmax(-1), 1,
                                 generator=torch.Generator().manual_seed(9))[:, 0]
    assert torch.equal(drawn, expected)
    other = pick(logits, temperature=1.0, top_k=None, top_p=None,
                 generator=torch.Generator().manual_seed(9))
    many = torch.stack([pick(logits, temperature=temperature, top_k=None, top_p=None,
                             generator=torch.Generator().manual_seed(s)) for s in range(20)])
    assert not torch.equal(many, torch.stack([other] * 20))  # the temperature matters


def test_generation_leaves_the_model_and_global_rng_as_they_were():
    model = _model(_config("tiny")).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    model.generate([[1, 2, 3]], 8, temperature=1.0, seed=0)
    assert torch.equal(torch.rand(2), expected)
    assert model.training  # restored; the balancer did not update meanwhile
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(prompts=[], max_new_tokens=4), "at least one prompt"),
    (dict(prompts=[[1], []], max_new_tokens=4), "at least one token"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens"),
    (dict(prompts=[[300]], max_new_tokens=4), "outside the vocabulary"),
    (dict(prompts=[[1] * 500], max_new_tokens=20), "exceeds max_seq_len"),
    (dict(prompts=[[1]], max_new_tokens=4, top_p=0.0), "top_p"),
])
def test_bad_generation_arguments_are_refused(kwargs, message):
    model = _model(_config("tiny"))
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs)


def test_cache_holds_kda_state_and_mla_latents_only_with_the_formula_sizes():
    config = _config("tiny")
    model = _model(config)
    cache = model.new_cache()
    sizes = []
    for context in (50, 150):
        x = torch.randint(0, 256, (1, context - cache.length))
        model.forward_cached(x, cache)
        sizes.append(cache.nbytes())
        assert cache.nbytes() == cache_bytes_formula(config, context)
    assert sizes[0]["kda"] == sizes[1]["kda"] > 0  # constant in length
    assert sizes[1]["mla"] == 3 * sizes[0]["mla"]  # linear in length
    kda = [e for e in cache.layers if isinstance(e, KDAState)]
    mla = [e for e in cache.layers if isinstance(e, LatentCache)]
    assert len(kda) == 3 and len(mla) == 1
    assert kda[0].state is not None and kda[0].state.dtype == torch.float32
    assert kda[0].state.shape == (1, 4, 32, 32)
    assert kda[0].tail is not None and kda[0].tail.shape == (1, 3, 3 * 128)
    (buffer,) = mla[0].buffers  # [normalized latent | shared key slice] per position
    assert buffer is not None and buffer.shape[0] == 1 and buffer.shape[2] == 64 + 16
    assert buffer.shape[1] >= 150  # the spare capacity is not counted above


def test_published_shapes_cache_sizes_follow_the_formula():
    """Kimi Linear 48B: 2 MiB of KDA state per layer per sequence, ~7.9 KiB of bf16 MLA
    latents per token (DESIGN §9)."""
    config = preset("kimi-linear-48b-a3b")
    one = cache_bytes_formula(config, 1, dtype_bytes=2)
    assert config.layer_types().count("kda") == 20
    state = 32 * 128 * 128 * 4
    assert state == 2 * 2**20 and one["kda"] == 20 * (state + 3 * 3 * 4096 * 2)
    assert one["mla"] == 7 * (512 + 64) * 2 and one["mla"] / 1024 == pytest.approx(7.875)


def test_a_cached_sequence_may_not_grow_past_max_seq_len():
    """Checked on the host each step (no device read): the prefill's padded mask once, then
    one more token per step."""
    model = _model(_config("tiny").replace(max_seq_len=40))
    cache = model.new_cache()
    ids = torch.randint(0, 256, (2, 39))
    real = torch.ones(2, 39, dtype=torch.bool)
    real[0, :5], real[1, :3] = False, False  # 34 and 36 tokens: the padding is no token
    model.forward_cached(ids, cache, real)
    for _ in range(4):  # up to 38 and 40 tokens
        model.forward_cached(ids[:, :1], cache)
    with pytest.raises(ValueError, match="a sequence of 41 tokens exceeds"):
        model.forward_cached(ids[:, :1], cache)
