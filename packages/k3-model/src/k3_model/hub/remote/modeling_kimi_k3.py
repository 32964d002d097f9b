"""Kimi K3 for transformers (``trust_remote_code``): K3 Train's ``k3_model.K3Model`` behind
``PreTrainedModel`` and ``GenerationMixin``, one implementation of the math.

Shipped beside an export by ``k3_model.hub.save_pretrained`` and imported by
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in an environment
that has ``k3-model`` (and its sibling ``k3-qkclip``) installed; without them, loading
says in one line how to install both (the folder's README.md has the line for where it
was exported). A plain forward is the model's full forward, each sequence's real tokens
(``attention_mask``) run on their own; ``generate`` decodes with the model's own decoding
state (KDA's recurrent state, MLA's latents), which travels between steps as
``past_key_values``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config

try:
    import k3_model
    import k3_model.hub
except ImportError:  # said when the model is built, with the folder's install line
    k3_model = None

INSTALL = ("pip install K3_TRAIN/packages/k3-qkclip K3_TRAIN/packages/k3-model "
           "(K3_TRAIN: a checkout of K3 Train; neither package is on PyPI)")


def _require_k3_model(folder: Any = None) -> Any:
    """``k3_model`` (with ``k3_model.hub``), or one ImportError line saying how to install
    it: the line the folder's README.md gives (where it was exported), else the general
    form."""
    if k3_model is not None:
        return k3_model
    line = INSTALL
    readme = Path(str(folder)) / "README.md" if folder is not None else None
    if readme is not None and readme.is_file():
        found = [text.strip() for text in readme.read_text(encoding="utf-8").splitlines()
                 if text.strip().startswith("pip install ")]
        if found:
            line = f"{found[0]} (the line in {readme}), or {INSTALL}"
    raise ImportError("this Kimi K3 folder's modeling code runs K3 Train's k3-model (with "
                      f"its sibling k3-qkclip), which is not installed here: {line}")


class K3DecodingState:
    """The model's decoding cache between ``generate`` steps (``past_key_values``)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.cache.length)


class KimiK3ForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = KimiK3Config
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: KimiK3Config, model: Any = None) -> None:
        super().__init__(config)
        if model is None:
            k3 = _require_k3_model(getattr(config, "_name_or_path", None))
            model = k3.K3Model(k3.hub.from_hub_config(config.to_dict()))
        self.model = model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any,
                        config: KimiK3Config | None = None, **kwargs: Any
                        ) -> KimiK3ForCausalLM:
        """The folder's weights, read and checked by ``k3_model.hub.load_pretrained``."""
        k3 = _require_k3_model(pretrained_model_name_or_path)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        config = config or KimiK3Config.from_pretrained(pretrained_model_name_or_path)
        model = k3.hub.load_pretrained(pretrained_model_name_or_path,
                                       dtype=dtype if isinstance(dtype, torch.dtype) else None)
        return cls(config, model).eval()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own decoding state

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                past_key_values: K3DecodingState | None = None, use_cache: bool | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Logits for ``input_ids``: the full forward, or (``use_cache`` or a decoding
        state given) a cached forward that continues the state. Padding in
        ``attention_mask`` is honoured: a full forward runs each sequence's real tokens (one
        run of them, left- or right-padded) alone, grouped by length, so they get the
        logits they get unpadded (a padded position's are zero); the first cached call
        prefills left-padded prompts together with the padding marked."""
        if past_key_values is None and not use_cache:
            return CausalLMOutputWithPast(logits=self._full_forward(input_ids, attention_mask))
        if past_key_values is None:
            past_key_values = K3DecodingState(self.model.new_cache())
            real = None if attention_mask is None or bool(attention_mask.all()) \
                else attention_mask.bool()
        else:
            real = None
        logits = self.model.forward_cached(input_ids, past_key_values.cache, real)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    def _full_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                      ) -> torch.Tensor:
        if attention_mask is None or bool(attention_mask.all()):
            logits, _ = self.model(input_ids)
            return logits
        real = attention_mask.bool()
        counts = real.sum(dim=1)
        starts = real.long().argmax(dim=1)
        ends = starts + counts
        positions = torch.arange(real.shape[1], device=real.device)
        runs = (positions >= starts[:, None]) & (positions < ends[:, None])
        if not bool((runs == real).all()) or not bool((counts > 0).all()):
            raise ValueError("attention_mask: each sequence's real tokens must be one run "
                             "(left or right padding), at least one token")
        logits = None
        groups: dict[tuple[int, int], list[int]] = {}
        for row, (start, count) in enumerate(zip(starts.tolist(), counts.tolist())):
            groups.setdefault((start, count), []).append(row)
        for (start, count), rows in groups.items():
            part, _ = self.model(input_ids[rows, start:start + count])
            if logits is None:
                logits = part.new_zeros((*input_ids.shape, part.shape[-1]))
            logits[rows, start:start + count] = part
        assert logits is not None
        return logits

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor,
                                      past_key_values: K3DecodingState | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        if isinstance(past_key_values, K3DecodingState):
            input_ids = input_ids[:, past_key_values.cache.length:]
        return {"input_ids": input_ids, "past_key_values": past_key_values,
                "attention_mask": attention_mask, "use_cache": True}
