"""model_config.custom_params.num_hidden_layers on a checkpoint with more layers: the first layers
run, exactly as a checkpoint saved with only them would (executor/model_loader/layer_cut.py), on
every family; the other layers' tensors are skipped, said once in the log."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from executor.model_loader.hf_config import load_hf_config
from executor.model_loader.layer_cut import LayerCut, layer_cut
from executor.offline.offline_inference import OfflineInference
from tests.engine_harness import make_inference, token_records
from tests.factories import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
# every family whose tiny config transformers builds a model of (Step-3.7 has no transformers model)
FAMILIES = sorted(
    path.parents[1].name
    for path in (ROOT / "models").glob("*/tiny_random/config.json")
    if path.parents[1].name != "step3p7_flash"
)
KEPT = 2
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# families whose config transformers rebuilds otherwise when saved with fewer layers: the cut runs,
# but no saved checkpoint is its reference
NO_CUT_CONFIG = {"gemma_4": "transformers makes the last layer of any Gemma 4 config full attention"}
PROMPTS = [[5, 9, 20, 30, 40, 7, 3, 11], [7, 3, 12, 60]]


def test_a_cut_skips_the_layers_not_built_and_numbers_the_mtp_layers_after_the_kept_ones():
    cut = LayerCut(kept=2, in_checkpoint=4)
    assert cut.checkpoint_name("model.layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert cut.checkpoint_name("model.layers.2.mlp.up_proj.weight") is None
    assert cut.checkpoint_name("model.language_model.layers.3.input_layernorm.weight") is None
    assert cut.checkpoint_name("model.layers.4.eh_proj.weight") == "model.layers.2.eh_proj.weight"  # MTP 0
    assert cut.checkpoint_name("mtp.layers.0.mlp.up_proj.weight") == "mtp.layers.0.mlp.up_proj.weight"
    assert cut.checkpoint_name("model.embed_tokens.weight") == "model.embed_tokens.weight"


def save_family(family: str, folder: Path) -> Path:
    """The family's tiny config with random weights, as transformers saves it."""
    config = transformers.AutoConfig.from_pretrained(ROOT / "models" / family / "tiny_random")
    for key in MTP_KEYS:  # transformers saves no MTP layer (test_a_cut_skips_... covers their names)
        if getattr(config, key, None):
            setattr(config, key, 0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def save_cut(full: Path, folder: Path, kept_layers: int) -> Path:
    """`full` as if it had been saved with its first `kept_layers` (in its own numbering) only."""
    folder.mkdir()
    config = load_hf_config(transformers.AutoConfig, str(full), {"num_hidden_layers": KEPT}).to_dict()
    del config["checkpoint_num_hidden_layers"]
    per_layer = config.get("per_layer_config")  # transformers' per-layer overrides: only kept layers' may stay
    if isinstance(per_layer, dict):
        config["per_layer_config"] = {key: value for key, value in per_layer.items() if int(key) < KEPT}
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(full / "generation_config.json", folder)
    tiny_tokenizer().save_pretrained(folder)
    tensors = load_file(full / "model.safetensors")
    kept = LayerCut(kept=kept_layers, in_checkpoint=10**6)  # no MTP layer in what transformers saves
    save_file({n: t for n, t in tensors.items() if kept.checkpoint_name(n) is not None}, folder / "model.safetensors")
    return folder


def greedy_tokens(inference: OfflineInference) -> list[list[int]]:
    return [request.output_token_ids for request in inference.generate(token_records(PROMPTS)).requests]


@pytest.mark.parametrize("family", FAMILIES)
def test_num_hidden_layers_runs_the_first_layers_of_a_deeper_checkpoint(family, tmp_path, caplog):
    full = save_family(family, tmp_path / "full")
    caplog.set_level(logging.INFO)
    settings = {"model_name": family}
    limits = {"num_blocks": 32, "max_model_len": 64, "max_new_tokens": 8}
    cut = make_inference(full, model_config=settings | {"custom_params": {"num_hidden_layers": KEPT}}, **limits)
    skipped = [r.message for r in caplog.records if "tensors were skipped" in r.message]
    assert len(skipped) == 1, skipped
    layers = layer_cut(cut.engine.worker.model)
    assert layers is not None and layers.in_checkpoint > layers.kept
    if family in NO_CUT_CONFIG:
        assert all(greedy_tokens(cut)), NO_CUT_CONFIG[family]
        return
    reference = make_inference(save_cut(full, tmp_path / "cut", layers.kept), model_config=settings, **limits)
    assert greedy_tokens(cut) == greedy_tokens(reference)
