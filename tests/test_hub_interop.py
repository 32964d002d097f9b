"""An exported run loads where none of our packages is installed: a fresh virtual
environment with only torch, transformers and safetensors.

1. A short run of the ``kimi-linear-tiny`` preset is trained and exported with
   ``k3-train export``. In the fresh environment ``AutoModelForCausalLM`` and
   ``AutoTokenizer`` load it from the folder alone, encode a prompt as our byte codec
   does, and greedy ``generate`` gives the same 24 tokens as our model.
2. The demo's own model (``tiny``, K3's additions) is exported in the Kimi K3 form, which
   transformers has no model class for: there ``safetensors`` reads every tensor, the
   tokenizer loads without any of the folder's code and without a question, the config is
   valid JSON naming ``kimi_k3``, and its modeling code (``trust_remote_code``) says in one
   line how to install k3-model and k3-qkclip. The folder's README then works as printed:
   its install line, then its example, run in the folder.

The environment costs about a minute (torch from the usual index or local wheel).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3_model.hub import load_pretrained
from k3_trainer.cli import main

transformers = pytest.importorskip("transformers")  # what the integration environment pins

BIN = "Scripts" if sys.platform == "win32" else "bin"
PROMPT = "def main("

OUTSIDE = r'''
import json, sys
from pathlib import Path
import importlib.util
assert not any(importlib.util.find_spec(name) for name in ("k3_model", "k3_trainer"))
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

linear, k3, prompt = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(linear)
model = AutoModelForCausalLM.from_pretrained(linear, dtype=torch.float32).eval()
inputs = tokenizer(prompt, return_tensors="pt")  # with its attention mask: the first token
ids = inputs.input_ids                         # is the end-of-document, also the pad token
out = model.generate(**inputs, max_new_tokens=24, do_sample=False, eos_token_id=None,
                     pad_token_id=tokenizer.eos_token_id)
tensors = {}
for shard in sorted(k3.glob("*.safetensors")):
    tensors.update(load_file(shard))
# the K3 form's tokenizer is a plain BPE file: read without any of the folder's code (and
# without a question: stdin is closed, a prompt would show in the output), as its README says
from transformers import PreTrainedTokenizerFast
k3_tokenizer = PreTrainedTokenizerFast.from_pretrained(k3)
try:  # the modeling code runs k3_model, which is not installed here
    AutoModelForCausalLM.from_pretrained(k3, trust_remote_code=True)
    k3_remote = "loaded"
except ImportError as exc:
    k3_remote = str(exc)
print(json.dumps({
    "class": type(model).__name__, "prompt_ids": ids[0].tolist(),
    "new_ids": out[0, ids.shape[1]:].tolist(), "eos": tokenizer.eos_token_id,
    "k3_tensors": len(tensors),
    "k3_model_type": json.loads((k3 / "config.json").read_text())["model_type"],
    "k3_prompt_ids": k3_tokenizer(prompt).input_ids, "k3_remote": k3_remote,
    "k3_untrusted_ids": AutoTokenizer.from_pretrained(k3, trust_remote_code=False)(
        prompt).input_ids,
}))
'''


def _run(args, *, cwd, env, timeout=900):
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, (f"{args} exited {result.returncode}\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def _greedy(model, ids: list[int], new: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(new):
            x = torch.cat([x, model(x)[0][:, -1:].argmax(-1)], dim=1)
    return x[0, len(ids):].tolist()


@pytest.mark.slow
def test_an_export_loads_with_only_transformers_and_safetensors(tmp_path, data_dir):
    runs = {"linear": "kimi-linear-tiny", "k3": "tiny"}
    for name, preset in runs.items():
        assert main(["train", "--run-dir", str(tmp_path / name), "--data", str(data_dir),
                     "--preset", preset, "--max-steps", "4", "--batch-size", "4",
                     "--eval-batches", "1"]) == 0
        assert main(["export", "--run-dir", str(tmp_path / name), "--out",
                     str(tmp_path / f"{name}-hub")]) == 0

    outside = tmp_path / "outside"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}}
    env.setdefault("OMP_NUM_THREADS", "1")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], cwd=outside, env=env)
    python = venv / BIN / "python"
    torch_spec = os.environ.get("K3_TORCH_SPEC", "==2.13.0")
    # --no-compile: one process imports from this venv, and compiling what it imports
    # costs less than byte-compiling every module of torch and transformers. (The
    # PIP_NO_COMPILE=1 this test used to set changed nothing: pip reads it as compile=1.)
    _run([python, "-m", "pip", "install", "--quiet", "--no-compile", f"torch{torch_spec}",
          "transformers==5.23.0", "safetensors"], cwd=outside, env=env)
    script = tmp_path / "outside.py"
    script.write_text(OUTSIDE)
    done = subprocess.run([str(python), "-I", str(script), str(tmp_path / "linear-hub"),
                           str(tmp_path / "k3-hub"), PROMPT], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])

    assert found["class"] == "KimiLinearForCausalLM"
    # a text begins as the run's documents do: after the end-of-document token
    assert found["prompt_ids"] == [0xFF, *PROMPT.encode()] == found["k3_prompt_ids"]
    assert found["eos"] == 0xFF
    ours = load_pretrained(tmp_path / "linear-hub", kda_backend="torch")
    assert found["new_ids"] == _greedy(ours, found["prompt_ids"], 24)
    assert found["k3_model_type"] == "kimi_k3"
    assert found["k3_untrusted_ids"] == found["k3_prompt_ids"]
    # one clear line, not a traceback, that installs both packages the code runs
    assert "k3-qkclip" in found["k3_remote"] and "k3-model" in found["k3_remote"]
    assert found["k3_tensors"] == len(_tensor_names(tmp_path / "k3-hub")) > 50

    # The folder's README, as printed: its install line, then its example in the folder.
    readme = (tmp_path / "k3-hub" / "README.md").read_text()
    install = _block(readme, "bash").strip()
    assert install.startswith("pip install ") and install in found["k3_remote"]
    _run([python, "-m", "pip", "install", "--quiet", *shlex.split(install)[2:]], cwd=outside,
         env=env)
    example = tmp_path / "example.py"
    example.write_text(_block(readme, "python"))
    printed = _run([python, "-I", example], cwd=tmp_path / "k3-hub", env=env).stdout
    assert printed.startswith(PROMPT) and len(printed.strip()) > len(PROMPT)


def _block(text: str, language: str) -> str:
    """The first fenced ``language`` block of a README."""
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            names.extend(f.keys())
    return names


PROMPTS = ["def main(", "The ", "import os\n"]


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """The built-in corpus with a small BPE trained on it."""
    out = tmp_path_factory.mktemp("bpe") / "data"
    assert main(["prepare", "--out", str(out), "--train-tokenizer", "512"]) == 0
    return out


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_transformers_continues_a_prompt_as_k3_train_sample_does(tokenizer, tmp_path,
                                                                 data_dir, bpe_data, capsys):
    """The README's lines, used as they are: the exported tokenizer puts the document start
    in front of the prompt as ``sample`` does, so greedy text is the same."""
    data = data_dir if tokenizer == "bytes" else bpe_data
    run, out = tmp_path / "run", tmp_path / "hub"
    assert main(["train", "--run-dir", str(run), "--data", str(data), "--preset",
                 "kimi-linear-tiny", "--max-steps", "15", "--batch-size", "8",
                 "--eval-batches", "1"]) == 0
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    auto_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        capsys.readouterr()
        assert main(["sample", "--run-dir", str(run), "--prompt", prompt, "--max-new-tokens",
                     "24", "--temperature", "0"]) == 0
        ours = capsys.readouterr().out.removesuffix("\n")
        inputs = auto_tokenizer(prompt, return_tensors="pt")  # as the README shows
        ids = inputs.input_ids
        assert ids[0, 0].item() == auto_tokenizer.bos_token_id  # the document start
        generated = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        theirs = prompt + auto_tokenizer.decode(generated[0, ids.shape[1]:],
                                                skip_special_tokens=True)
        assert theirs == ours, prompt
