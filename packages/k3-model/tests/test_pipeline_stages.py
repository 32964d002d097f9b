"""A K3Model cut into stages (k3_model.pipeline), run stage after stage in one process,
is the whole model: the same loss, bitwise, and every parameter's gradient (the last
stage's bitwise, earlier stages' within rounding: a crossing tensor gathers gradients from
both sides of a cut in another order), with block
Attention Residuals' partial sum and committed blocks crossing each cut (and their
gradients flowing back through them), documents kept apart, under the same names."""

from __future__ import annotations

import copy

import pytest
import torch

from k3_model import K3Model, preset
from k3_model.pipeline import StageForward, keep_stages

CONFIG = preset("tiny", d_model=64, n_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, d_ff=96, moe_d_ff=32, moe_latent_dim=32,
                kda_chunk_size=16, max_seq_len=64)


@pytest.mark.parametrize("cuts", [[range(0, 2), range(2, 4)],
                                  [range(0, 1), range(1, 3), range(3, 4)]])
def test_stages_run_one_after_another_are_the_whole_model(cuts):
    torch.manual_seed(0)
    whole = K3Model(CONFIG).eval()  # eval: the balancer does not update in between
    with torch.no_grad():  # zero-initialized queries would read every source alike, and
        for name, parameter in whole.named_parameters():  # no gradient would reach 1/rms
            if name.endswith(".query"):
                parameter.normal_(0.0, 0.5)
    assert CONFIG.attn_res_block_size and CONFIG.n_layers == 4
    x = torch.randint(0, 16, (2, 32))
    y = torch.randint(0, 16, (2, 32))
    ids = torch.cumsum((x == 3).long(), dim=1)  # a document starts at every token 3
    _, loss = whole(x, targets=y, document_ids=ids)
    loss.backward()

    stages, parts = [], []
    for index, layers in enumerate(cuts):
        part = copy.deepcopy(whole)
        part.zero_grad(set_to_none=True)
        first, last = index == 0, index == len(cuts) - 1
        keep_stages(part, list(layers), first=first, last=last)
        parts.append(part)
        stages.append(StageForward(part, layers, first=first, last=last))
    inputs: tuple[torch.Tensor, ...] = (x,)
    received: list[tuple[torch.Tensor, ...]] = []
    for stage in stages:
        out = stage(*inputs, document_ids=ids)
        out = out if isinstance(out, tuple) else (out,)
        _, shapes = stage.example_io(2, 32)
        assert [tuple(o.shape) for o in out] == [tuple(s.shape) for s in shapes]
        # What the next stage receives: detached leaves, as PipelineStage hands them over.
        inputs = tuple(o.detach().requires_grad_(True) for o in out)
        received.append((out, inputs))
    staged_loss = stages[-1].loss(received[-1][0][0], y)  # the last stage's own output
    assert torch.equal(staged_loss, loss)
    with torch.no_grad():  # each target's loss, as the whole model's reduction="none"
        _, per_token = whole(x, targets=y, document_ids=ids, reduction="none")
        assert torch.equal(stages[-1].loss(received[-1][0][0], y, "none"), per_token)
        logits, _ = whole(x, document_ids=ids)  # the last stage's logits: the whole model's
        assert torch.equal(stages[-1].logits(received[-1][0][0]), logits)
    # Backward stage by stage: each stage's outputs take the next stage's input grads.
    staged_loss.backward()
    for out, inputs in reversed(received[:-1]):
        used = [(o, i.grad) for o, i in zip(out, inputs, strict=True) if i.grad is not None]
        assert used  # the residual stream at least
        torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    names = dict(whole.named_parameters())
    seen = set()
    for index, part in enumerate(parts):
        for name, parameter in part.named_parameters():
            assert name not in seen
            seen.add(name)
            if index == len(parts) - 1:  # the last stage's: one process's own bits
                assert torch.equal(parameter.grad, names[name].grad), name
            else:  # a crossing tensor sums its users' gradients from both sides of a cut,
                # in another order than one autograd graph: rounding, not bits
                torch.testing.assert_close(parameter.grad, names[name].grad, rtol=1e-5,
                                           atol=1e-6, msg=name)
    assert seen == set(names)


def test_tied_embeddings_cannot_be_cut():
    model = K3Model(preset("tiny", tie_embeddings=True))
    with pytest.raises(ValueError, match="untie them"):
        keep_stages(model, [0], first=True, last=False)
