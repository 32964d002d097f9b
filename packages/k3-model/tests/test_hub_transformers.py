"""The hub format proven against transformers' own ``kimi_linear`` model (an outside
implementation): its folders load into ours and ours into it, with the same logits at
prompt lengths that cross KDA's chunk boundaries, and the same greedy continuation, by
recomputing the prefix and by decoding with the cache.

Skipped only where transformers is absent; its test environments pin it (the ``hub-test``
extra: ``transformers==5.23.0``).
"""

from __future__ import annotations

import pytest
import torch

from k3_model import K3Model, preset
from k3_model.hub import load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

LENGTHS = (1, 63, 200)  # one token; just under one chunk of 64; past three chunks


def _relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def _transformers_model(seed: int = 0):
    """A random tiny KimiLinearForCausalLM: 3 KDA layers + 1 MLA, a dense first layer, MoE."""
    torch.manual_seed(seed)
    config = transformers.KimiLinearConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=2.446, first_k_dense_replace=1,
        linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():  # a trained router has a non-zero selection bias
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.02)
    return model


def _greedy(model: K3Model, prompt: torch.Tensor, new: int) -> list[int]:
    """Our greedy continuation: the full forward for every new token (no cache)."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(new):
            logits, _ = model(ids)
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, prompt.shape[1]:].tolist()


def test_a_transformers_saved_model_loads_and_computes_the_same_logits(tmp_path):
    theirs = _transformers_model()
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", kda_backend="torch")
    assert ours.config.kda_decay == "softplus" and ours.config.layer_types() == [
        "kda", "kda", "kda", "mla"]
    generator = torch.Generator().manual_seed(1)
    for length in LENGTHS:
        x = torch.randint(0, 300, (2, length), generator=generator)
        with torch.no_grad():
            assert _relative(ours(x)[0], theirs(x).logits) < 1e-5, length


def test_our_export_loads_in_transformers_with_the_same_logits_and_greedy_tokens(tmp_path):
    torch.manual_seed(0)
    ours = K3Model(preset("kimi-linear-tiny", kda_backend="torch")).eval()
    with torch.no_grad():
        for layer in ours.moe_layers().values():
            layer.balancer.bias.normal_(0.0, 0.02)
    save_pretrained(ours, tmp_path / "out", bos_token_id=255, eos_token_id=255)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True)
    theirs.eval()
    assert type(theirs).__name__ == "KimiLinearForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys",
                                         "mismatched_keys")), info
    generator = torch.Generator().manual_seed(2)
    for length in LENGTHS:
        x = torch.randint(0, 255, (2, length), generator=generator)
        with torch.no_grad():
            assert _relative(ours(x)[0], theirs(x).logits) < 1e-5, length
    prompt = torch.randint(0, 255, (1, 12), generator=generator)
    with torch.no_grad():
        generated = theirs.generate(prompt, max_new_tokens=64, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    expected = generated[0, 12:].tolist()
    assert expected[:32] == _greedy(ours, prompt, 32)  # recomputing the prefix
    # and decoding with our cache (KDA state, MLA latents): the same 64 tokens
    assert ours.generate([prompt[0].tolist()], 64, temperature=0) == [expected]
