"""Device→host synchronizations per training update stay within the spec's own.

The spec needs one host read per microbatch (the finite-loss check) and one for the
gradient norm (with the scaler's found-inf, which ``scaler.step`` reads once more itself):
``gradient_accumulation_steps + 2`` at most, whatever the model. Everything else — MoE
routing, QK-Clip observation, validation and rescaling, window statistics — must stay on
the device between logging boundaries. On CPU nothing really waits, so the test counts the
Python-level calls that would wait on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import pytest
import torch
from trainer_helpers import build_parts, train_config

from k3_model import preset
from k3_trainer import Callback, FP16SkipHarness, Trainer

# Every Tensor method that copies a value to the host (and so waits for the device).
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@contextlib.contextmanager
def counting_host_reads(calls: list[str], host_resident: set[int]) -> Iterator[None]:
    """Count host reads of tensors, except those in ``host_resident`` (ids of tensors that
    live on the host by design, so reading them never waits for a device)."""
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name: str):
        original = originals[name]

        def counted(self, *args, **kwargs):
            if id(self) not in host_resident:
                calls.append(name)
            return original(self, *args, **kwargs)
        return counted

    try:
        for name in _READS:
            setattr(torch.Tensor, name, wrap(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


# The K3 hybrid preset (KDA + Gated MLA, Attention Residuals, LatentMoE with a shared
# expert, SiTU-GLU), narrowed to keep the test fast.
HYBRID = preset("tiny", d_model=64, n_heads=2, kv_lora_rank=16, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, d_ff=128, moe_d_ff=64, moe_latent_dim=32,
                max_seq_len=64)


@pytest.mark.parametrize(("accumulation", "scaler"), [(1, False), (3, False), (2, True)])
def test_one_update_reads_the_host_at_most_accumulation_plus_two_times(
        data_dir, accumulation, scaler):
    assert HYBRID.layer_types().count("kda") >= 1 and HYBRID.n_moe_layers >= 1
    config = train_config(max_steps=6, gradient_accumulation_steps=accumulation,
                          log_interval=6, eval_interval=6, checkpoint_interval=6,
                          qk_clip_tau=1.0)  # tau low: heads are clipped every step
    model, opt, tl, vl = build_parts(config, data_dir, HYBRID)
    counts = _reads_per_update(lambda callback: Trainer(
        model, opt, (tl, vl), config, callbacks=[callback],
        grad_scaler=FP16SkipHarness(init_scale=2.0**8) if scaler else None), opt)
    assert len(counts) == 5
    assert max(counts) <= accumulation + 2, counts


def _reads_per_update(build, opt) -> list[int]:
    """The host reads of each update but the first of ``build(callback)``'s fit: between
    two on_step_end calls lies exactly one update (the final step's log, eval and
    checkpoint come after the last call and are not counted)."""
    calls: list[str] = []
    per_update: list[int] = []
    # torch's AdamW keeps each parameter's `step` counter on the host (non-capturable
    # mode), so reading it never waits for a GPU: on this CPU-only test it is excluded.
    adam_steps: set[int] = set()

    class CountPerUpdate(Callback):
        def on_step_end(self, trainer, stats) -> None:
            per_update.append(len(calls))
            adam_steps.update(id(s["step"]) for s in opt.state.values()
                              if isinstance(s.get("step"), torch.Tensor) and s["step"].ndim == 0)

    trainer = build(CountPerUpdate())
    with counting_host_reads(calls, adam_steps):
        trainer.fit()
    return [b - a for a, b in itertools.pairwise(per_update)]


def test_a_mixtures_loss_by_source_reads_the_host_only_at_the_log(data_dir):
    """Each row's loss goes to its source's sums on the device: a mixture's update reads the
    host no more than one dataset's."""
    from k3_trainer.data import MixtureLoader, Source

    config = train_config(max_steps=6, log_interval=6, eval_interval=6, checkpoint_interval=6)
    model, opt, _, _ = build_parts(config, data_dir, HYBRID)
    sources = [Source("a", data_dir, 0.6), Source("b", data_dir, 0.4)]
    loaders = tuple(MixtureLoader(sources, split, config.batch_size, config.seq_len)
                    for split in ("train", "val"))
    trainers: list[Trainer] = []

    def build(callback):
        trainers.append(Trainer(model, opt, loaders, config, callbacks=[callback]))
        return trainers[-1]

    counts = _reads_per_update(build, opt)
    assert trainers[0].by_source is not None
    model, opt, tl, vl = build_parts(config, data_dir, HYBRID)
    alone = _reads_per_update(lambda callback: Trainer(model, opt, (tl, vl), config,
                                                       callbacks=[callback]), opt)
    assert len(counts) == 5 and counts == alone, (counts, alone)  # one dataset's reads
