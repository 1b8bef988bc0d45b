"""The model's HF config as a run builds it: config.json, then what model_config.custom_params replaces.

cann-recipes lets `custom_params.num_hidden_layers` replace the layer count of config.json (its
model worker does so right after reading the config), so that a huge model runs with its first few
layers for a smoke test; it is the one custom_params key that changes the HF config, here too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)


def load_hf_config(config_cls: Any, model_path: str, custom_params: Mapping[str, Any]) -> Any:
    hf_config = config_cls.from_pretrained(model_path)
    num_layers = custom_params.get("num_hidden_layers")
    if num_layers is not None:
        logger.info(
            "custom_params.num_hidden_layers: %d of the config's %d layers", num_layers, hf_config.num_hidden_layers
        )
        hf_config.num_hidden_layers = num_layers
        layer_types = getattr(hf_config, "layer_types", None)
        if isinstance(layer_types, list):  # per-layer kinds (sliding or full attention) must match the count
            hf_config.layer_types = layer_types[:num_layers]
    return hf_config
