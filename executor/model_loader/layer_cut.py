"""A checkpoint read by a model cut to its first layers (model_config.custom_params.num_hidden_layers).

hf_config.py lowers the config's layer count and keeps the checkpoint's own as
`checkpoint_num_hidden_layers`; the model builds that many fewer decoder layers. Here the checkpoint's
tensors of the layers it does not build are skipped, and the tensors numbered after the decoder layers
(the MTP layers a checkpoint keeps as `model.layers.{N + i}`) are numbered down by as many, so
that each family's own `load_weights` reads a checkpoint that looks as if it had been saved cut.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from executor.types_.checkpoint_tensor import CheckpointTensor

logger = logging.getLogger(__name__)

CHECKPOINT_LAYERS_KEY = "checkpoint_num_hidden_layers"  # set on the HF config by a cut
# A decoder layer's tensor: `layers.{i}.` first, or under model. / model.language_model. (multimodal
# checkpoints); an MTP module of its own (`mtp.layers.0.`) is not one.
LAYER_TENSOR = re.compile(r"^(?P<prefix>(?:model\.)?(?:language_model\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True, slots=True)
class LayerCut:
    """The checkpoint's decoder layers `kept` and up are not built; those from `in_checkpoint` on
    (MTP layers) are renumbered to follow the kept ones. Counts in the checkpoint's layer numbering."""

    kept: int
    in_checkpoint: int

    def checkpoint_name(self, name: str) -> str | None:
        """`name` as the cut model reads it; None for a tensor of a layer it does not build."""
        match = LAYER_TENSOR.match(name)
        if match is None:
            return name
        index = int(match["index"])
        if index < self.kept:
            return name
        if index < self.in_checkpoint:
            return None
        return f"{match['prefix']}.{index - (self.in_checkpoint - self.kept)}.{match['rest']}"

    def weights(self, weights: Iterator[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
        """The checkpoint's tensors for the cut model; says once in the log how many were skipped."""
        skipped = 0
        for name, tensor in weights:
            renamed = self.checkpoint_name(name)
            if renamed is None:
                skipped += 1
            else:
                yield renamed, tensor
        logger.info(
            "custom_params.num_hidden_layers: the checkpoint's layers %d..%d are not run; "
            "their %d tensors were skipped",
            self.kept,
            self.in_checkpoint - 1,
            skipped,
        )


def layer_cut(model: Any) -> LayerCut | None:
    """The cut of `model`'s HF config (None when it runs every layer). The model class says how
    many decoder layers a checkpoint numbers under a config (module/causal_lm.py's
    num_checkpoint_layers: the config's num_hidden_layers unless the family counts otherwise)."""
    config = getattr(model, "config", None)
    in_checkpoint = getattr(config, CHECKPOINT_LAYERS_KEY, None)
    if in_checkpoint is None or in_checkpoint == config.num_hidden_layers:
        return None
    whole = copy.copy(config)
    whole.num_hidden_layers = in_checkpoint
    model_cls = type(model)
    return LayerCut(kept=model_cls.num_checkpoint_layers(config), in_checkpoint=model_cls.num_checkpoint_layers(whole))
