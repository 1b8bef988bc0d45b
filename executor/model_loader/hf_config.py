"""The model's HF config as a run builds it: config.json, then what model_config.custom_params replaces.

cann-recipes lets `custom_params.num_hidden_layers` replace the layer count of config.json (its
model worker does so right after reading the config), so that a huge model runs with its first few
layers for a smoke test; it is the one custom_params key that changes the HF config, here too. The
checkpoint's other layers are skipped as it loads (layer_cut.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from executor.model_loader.layer_cut import CHECKPOINT_LAYERS_KEY

logger = logging.getLogger(__name__)
# Per-layer lists (layer_types: sliding or full attention; mlp_layer_types: dense or sparse; ...),
# cut with the layer count where they hold one entry per layer.
PER_LAYER_KEY = re.compile(r"_types$|_list$")


def load_hf_config(config_cls: Any, model_path: str, custom_params: Mapping[str, Any]) -> Any:
    hf_config = config_cls.from_pretrained(model_path)
    num_layers = custom_params.get("num_hidden_layers")
    if num_layers is not None:
        logger.info(
            "custom_params.num_hidden_layers: %d of the config's %d layers", num_layers, hf_config.num_hidden_layers
        )
        setattr(hf_config, CHECKPOINT_LAYERS_KEY, hf_config.num_hidden_layers)  # layer_cut.py reads it
        for key, value in list(vars(hf_config).items()):
            if PER_LAYER_KEY.search(key) and isinstance(value, list) and len(value) == hf_config.num_hidden_layers:
                setattr(hf_config, key, value[:num_layers])
        hf_config.num_hidden_layers = num_layers
    return hf_config
