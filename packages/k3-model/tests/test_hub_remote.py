"""The Kimi K3 form in transformers: an export ships modeling code that transformers loads
with ``trust_remote_code`` (there is no ``kimi_k3`` model in transformers), running
``K3Model`` itself: our logits, our greedy tokens, decoded with the model's state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from k3_model import K3Model, preset
from k3_model.hub import save_pretrained

transformers = pytest.importorskip("transformers")  # the hub-test extra


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    k3 = K3Model(preset("tiny", kda_backend="torch")).eval()
    with torch.no_grad():  # trained-looking reads and router biases
        for module in k3.modules():
            if isinstance(getattr(module, "query", None), torch.nn.Parameter):
                module.query.normal_(0.0, 0.05)
        for layer in k3.moe_layers().values():
            layer.balancer.bias.normal_(0.0, 0.02)
    root = tmp_path_factory.mktemp("remote")
    save_pretrained(k3, root / "k3", bos_token_id=255, eos_token_id=255)
    linear = K3Model(preset("kimi-linear-tiny", kda_backend="torch")).eval()
    save_pretrained(linear, root / "linear", bos_token_id=255, eos_token_id=255)
    return k3, root


def test_a_kimi_k3_export_loads_with_remote_code_and_computes_our_logits(folders, monkeypatch,
                                                                        tmp_path):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    ours, root = folders
    config = json.loads((root / "k3" / "config.json").read_text())
    assert config["model_type"] == "kimi_k3"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_k3.KimiK3ForCausalLM"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        root / "k3", trust_remote_code=True, dtype=torch.float32)
    assert type(theirs).__name__ == "KimiK3ForCausalLM"
    x = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(x)[0]
        got = theirs(input_ids=x).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5


def test_generate_decodes_with_the_models_state_and_our_greedy_tokens(folders, monkeypatch,
                                                                      tmp_path):
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    ours, root = folders
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        root / "k3", trust_remote_code=True, dtype=torch.float32)
    widths: list[int] = []
    cached = theirs.model.forward_cached

    def spy(x, cache, real=None):
        widths.append(x.shape[1])
        return cached(x, cache, real)

    theirs.model.forward_cached = spy
    prompt = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(2))
    out = theirs.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert out[0, 12:].tolist() == ours.generate([prompt[0].tolist()], 24, temperature=0)[0]
    assert widths == [12] + [1] * 23  # the prompt once, then one token per step


def test_a_padded_batch_gets_each_prompts_own_logits_and_tokens(folders, monkeypatch,
                                                               tmp_path):
    """``attention_mask`` in every forward: a left- (and a right-) padded batch's real
    positions get the logits each prompt gets alone, and generate continues each prompt
    as it would alone."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    ours, root = folders
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        root / "k3", trust_remote_code=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 255, (n,), generator=generator) for n in (5, 12, 5)]
    for side in ("left", "right"):
        ids = torch.zeros(3, 12, dtype=torch.long)
        mask = torch.zeros(3, 12, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            at = slice(12 - len(prompt), 12) if side == "left" else slice(0, len(prompt))
            ids[row, at], mask[row, at] = prompt, 1
        with torch.no_grad():
            logits = theirs(input_ids=ids, attention_mask=mask).logits
        for row, prompt in enumerate(prompts):
            at = slice(12 - len(prompt), 12) if side == "left" else slice(0, len(prompt))
            with torch.no_grad():
                alone = ours(prompt[None])[0][0]
            assert float((logits[row, at] - alone).abs().max()) <= 1e-6 * float(
                alone.abs().max()), (side, row)
    ids, mask = ids.clone(), mask.clone()  # left-padded again, for generate
    for row, prompt in enumerate(prompts):
        ids[row], mask[row] = 0, 0
        ids[row, 12 - len(prompt):], mask[row, 12 - len(prompt):] = prompt, 1
    out = theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        assert out[row, 12:].tolist() == ours.generate([prompt.tolist()], 6,
                                                       temperature=0)[0], row


def test_a_kimi_linear_export_stays_native(folders):
    _, root = folders
    config = json.loads((root / "linear" / "config.json").read_text())
    assert "auto_map" not in config and config["model_type"] == "kimi_linear"
    assert not list((root / "linear").glob("*.py"))


def test_remote_code_without_k3_model_says_what_to_install(folders, tmp_path):
    _, root = folders
    script = ("import sys; sys.modules['k3_model'] = None\n"
              "from transformers import AutoModelForCausalLM\n"
              f"AutoModelForCausalLM.from_pretrained({str(root / 'k3')!r}, "
              "trust_remote_code=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={"HF_MODULES_CACHE": str(tmp_path / "modules"),
                               "PATH": "/usr/bin:/bin"}, timeout=300)
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    # one line that installs both packages the code runs: the folder's README gives where
    # they came from when it was exported, and the general form from a K3 Train checkout
    from k3_model.hub.card import install_line

    assert "k3-qkclip" in line and "k3-model" in line
    assert install_line() in line and "K3_TRAIN/packages/k3-qkclip" in line
    assert install_line() in (root / "k3" / "README.md").read_text()
