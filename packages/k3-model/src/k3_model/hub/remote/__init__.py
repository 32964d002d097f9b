"""The Kimi K3 form's modeling code for transformers (``trust_remote_code``).

transformers has no ``kimi_k3`` model, so a Kimi K3 export ships two files beside its
weights (``configuration_kimi_k3.py``, ``modeling_kimi_k3.py``) and names them in
``config.json``'s ``auto_map``; they adapt ``k3_model.K3Model`` (installed, not copied) to
``PreTrainedModel``/``GenerationMixin``. They are read here as text, never imported by
k3-model itself (they import transformers).
"""

from __future__ import annotations

from importlib.resources import files

REMOTE_FILES = ("configuration_kimi_k3.py", "modeling_kimi_k3.py")
AUTO_MAP = {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForCausalLM"}


def remote_files() -> dict[str, str]:
    """``{file name: text}`` of the modeling code a Kimi K3 folder ships."""
    return {name: files(__name__).joinpath(name).read_text(encoding="utf-8")
            for name in REMOTE_FILES}
