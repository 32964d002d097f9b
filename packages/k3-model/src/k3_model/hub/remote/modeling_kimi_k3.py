"""Kimi K3 for transformers (``trust_remote_code``): K3 Train's ``k3_model.K3Model`` behind
``PreTrainedModel`` and ``GenerationMixin``, one implementation of the math.

Shipped beside an export by ``k3_model.hub.save_pretrained`` and imported by
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in an environment
that has ``k3-model`` installed. A plain forward is the model's full forward; ``generate``
decodes with the model's own decoding state (KDA's recurrent state, MLA's latents), which
travels between steps as ``past_key_values``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_kimi_k3 import KimiK3Config

try:
    from k3_model import K3Model
    from k3_model.hub import from_hub_config, load_pretrained
except ImportError as exc:
    raise ImportError("this Kimi K3 folder's modeling code runs K3 Train's model, which is "
                      "not installed: pip install k3-model") from exc


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

    def __init__(self, config: KimiK3Config, model: K3Model | None = None) -> None:
        super().__init__(config)
        self.model = model if model is not None else K3Model(from_hub_config(config.to_dict()))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any,
                        config: KimiK3Config | None = None, **kwargs: Any
                        ) -> KimiK3ForCausalLM:
        """The folder's weights, read and checked by ``k3_model.hub.load_pretrained``."""
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        dtype = getattr(torch, dtype) if isinstance(dtype, str) and dtype != "auto" else dtype
        config = config or KimiK3Config.from_pretrained(pretrained_model_name_or_path)
        model = load_pretrained(pretrained_model_name_or_path,
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
        state given) a cached forward that continues the state; left padding in
        ``attention_mask`` is honoured on the first cached call."""
        if past_key_values is None and not use_cache:
            logits, _ = self.model(input_ids)
            return CausalLMOutputWithPast(logits=logits)
        if past_key_values is None:
            past_key_values = K3DecodingState(self.model.new_cache())
            real = None if attention_mask is None or bool(attention_mask.all()) \
                else attention_mask.bool()
        else:
            real = None
        logits = self.model.forward_cached(input_ids, past_key_values.cache, real)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor,
                                      past_key_values: K3DecodingState | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      **kwargs: Any) -> dict[str, Any]:
        if isinstance(past_key_values, K3DecodingState):
            input_ids = input_ids[:, past_key_values.cache.length:]
        return {"input_ids": input_ids, "past_key_values": past_key_values,
                "attention_mask": attention_mask, "use_cache": True}
