"""The export's ``README.md``: what the folder is, how transformers loads it, and for the
Kimi K3 form the line that installs the packages its modeling code runs.

The Kimi K3 form's modeling code runs ``k3_model`` (and with it ``k3_qkclip``), which are
not on PyPI. The line that installs them is written from where they are installed in the
environment that exports (pip's record of it, ``direct_url.json``: a folder, a wheel, a
git URL, or an index), so a user given the folder learns where its code came from; the
README adds the general form (the two package folders of a K3 Train checkout). Nothing of
the packages is copied into the folder.
"""

from __future__ import annotations

import json
import shlex
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from urllib.parse import unquote, urlparse

README = "README.md"
HEADER = "(written by K3 Train)"
"""The end of an export README's first line: what tells it from a README of one's own."""
PACKAGES = ("k3-qkclip", "k3-model")
"""What the Kimi K3 form's modeling code imports, in install order (k3-model pins
k3-qkclip exactly, so pip must see both at once)."""
CHECKOUT_LINE = ("pip install K3_TRAIN/packages/k3-qkclip K3_TRAIN/packages/k3-model"
                 "    # K3_TRAIN: a checkout of K3 Train")
"""The general form, from a checkout of the repository (the packages are not on PyPI)."""


def _requirement(name: str) -> str:
    """How pip would install ``name`` again from where this environment got it."""
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return name
    raw = dist.read_text("direct_url.json")
    if not raw:
        return f"{name}=={dist.version}"  # from an index
    try:
        info = json.loads(raw)
        url = str(info["url"])
    except (ValueError, KeyError, TypeError):
        return f"{name}=={dist.version}"
    vcs = info.get("vcs_info")
    if isinstance(vcs, dict):
        sub = info.get("subdirectory")
        return (f"{name} @ {vcs.get('vcs', 'git')}+{url}@{vcs.get('commit_id', '')}"
                + (f"#subdirectory={sub}" if sub else ""))
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return unquote(parsed.path)  # a folder (editable or not) or a wheel file
    return f"{name} @ {url}"


def written_by_us(path: Path) -> bool:
    """Whether the README at ``path`` is one an export wrote, as written: the card of its
    model type (first line), but for the install line (another environment's)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    first = text.partition("\n")[0]
    if not (first.startswith("# `") and first.endswith(HEADER)):
        return False
    model_type = first[3:].partition("`")[0]
    return any(_unpinned(text) == _unpinned(model_card(model_type, remote=remote))
               for remote in (False, True))


def _unpinned(text: str) -> str:
    """``text`` without the environment's install line (the one line that varies)."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("pip install ") or "K3_TRAIN" in line)


def install_line() -> str:
    """``pip install …`` of :data:`PACKAGES` from where this environment has them."""
    return "pip install " + " ".join(shlex.quote(_requirement(name)) for name in PACKAGES)


def model_card(model_type: str, *, remote: bool) -> str:
    """The README of an export of ``model_type``; ``remote``: it ships modeling code (the
    Kimi K3 form). Its examples run in the folder itself (``"."``; elsewhere, the folder's
    path in its place), so an export's files do not depend on where it was written."""
    name = '"."'
    lines = [f"# `{model_type}` model {HEADER}", ""]
    if not remote:
        lines += [
            "transformers (5.x, its own `kimi_linear` model), vLLM and SGLang load this folder "
            "as it is; in the folder (elsewhere, its path in place of `\".\"`):", "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f"tokenizer = AutoTokenizer.from_pretrained({name})",
            f"model = AutoModelForCausalLM.from_pretrained({name})",
            'out = model.generate(**tokenizer("def main(", return_tensors="pt"), '
            "max_new_tokens=20)",
            "print(tokenizer.decode(out[0], skip_special_tokens=True))", "```", ""]
        return "\n".join(lines)
    lines += [
        f"transformers has no `{model_type}` model: this folder ships its modeling code "
        "(`configuration_kimi_k3.py`, `modeling_kimi_k3.py`), which runs K3 Train's "
        "`k3_model` package, and `k3_model` needs its sibling `k3_qkclip`. Neither is on "
        "PyPI. Where this folder was exported they were installed from:", "",
        "```bash", install_line(), "```", "",
        "or, from a checkout of K3 Train:", "", "```bash", CHECKOUT_LINE, "```", "",
        "Then (torch and transformers installed), in the folder (elsewhere, its path in "
        'place of `"."`):', "", "```python",
        "from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast",
        f"tokenizer = PreTrainedTokenizerFast.from_pretrained({name})",
        f"model = AutoModelForCausalLM.from_pretrained({name}, trust_remote_code=True)",
        'out = model.generate(**tokenizer("def main(", return_tensors="pt"), '
        "max_new_tokens=20)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))", "```", "",
        "The tokenizer is a plain byte-level BPE file (`tokenizer.json`): "
        "`PreTrainedTokenizerFast` reads it without any code of the folder. "
        "`AutoTokenizer.from_pretrained(folder)` reads `config.json` first, whose model "
        f"type (`{model_type}`) only the folder's code defines, so transformers asks before "
        "running that code; `trust_remote_code=True` (it runs the configuration file "
        "alone, which needs transformers only) or `trust_remote_code=False` (then it "
        "loads the tokenizer without) answers it.", ""]
    return "\n".join(lines)


__all__ = ["CHECKOUT_LINE", "HEADER", "PACKAGES", "README", "install_line", "model_card",
           "written_by_us"]
