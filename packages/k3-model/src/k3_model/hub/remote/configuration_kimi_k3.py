"""The Kimi K3 configuration for transformers (``trust_remote_code``): the hub
``config.json`` as it is (``model_type: kimi_k3`` and its ``text_config``), which
``k3_model.hub`` reads into a ``K3Config``. Shipped beside an export by
``k3_model.hub.save_pretrained``; transformers has no ``kimi_k3`` model of its own."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"

    def __init__(self, text_config: dict[str, Any] | PretrainedConfig | None = None,
                 **kwargs: Any) -> None:
        # a config object, as transformers expects of a sub-config (generation reads it)
        self.text_config = text_config if isinstance(text_config, PretrainedConfig) else \
            PretrainedConfig(**(text_config or {}))
        super().__init__(**kwargs)
