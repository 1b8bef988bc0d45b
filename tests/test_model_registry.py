"""model_config.model_name finds its folder: a folder name, or a cann-recipes model name a folder's
package lists in model_names."""

from __future__ import annotations

from pathlib import Path

import pytest

import models
from executor.core.config import ConfigError
from executor.core.config.model_registry import check_model_name, model_folder

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


@pytest.mark.parametrize(
    ("model_name", "folder"),
    [
        ("llama", "llama"),
        ("deepseek_v2", "deepseek_v2"),
        ("deepseek_v2_lite", "deepseek_v2"),
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_r1", "deepseek_v3"),
        ("kimi_k2", "deepseek_v3"),
        ("kimi_k2_thinking", "deepseek_v3"),
        ("deepseek_v3_2_exp", "deepseek_v3_2"),
        ("glm_5", "glm_5"),
        ("glm_5_2", "glm_5"),
        ("GLM-5.2", "glm_5"),
        ("qwen25_7b_instruct", "qwen2"),
        ("qwen3_8b", "qwen3"),
        ("qwen3_moe", "qwen3_moe"),
        ("gpt_oss", "gpt_oss"),
        ("longcat_flash", "longcat_flash"),
        ("step3p7_flash", "step3p7_flash"),
        ("qwen3.5", "qwen3_5_moe"),
        ("qwen3_next", "qwen3_next"),
        ("deepseek_v4", "deepseek_v4"),
        ("kimi_linear", "kimi_linear"),
        ("bailing_hybrid", "bailing_hybrid"),
        ("hy3", "hy3"),
        ("gemma_4", "gemma_4"),
        ("", models.DEFAULT_MODEL_FOLDER),
    ],
)
def test_a_folder_or_a_cann_recipes_model_name_finds_its_folder(model_name, folder):
    assert model_folder(model_name) == folder


@pytest.mark.parametrize("model_name", sorted(models.NOT_BUILT))
def test_a_cann_recipes_model_of_an_architecture_not_built_says_so(model_name):
    with pytest.raises(ConfigError, match=f"'{model_name}' in run.yaml: its architecture is not built here"):
        check_model_name(model_name, "run.yaml")


def test_an_unknown_model_name_lists_folders_and_names_on_one_line():
    with pytest.raises(ConfigError) as err:
        check_model_name("gpt9", "run.yaml")
    message = str(err.value)
    folders = ", ".join(sorted(path.parent.name for path in MODELS.glob("*/__init__.py")))
    assert "\n" not in message and f"available folders: {folders}" in message and "deepseek_r1" in message


def test_every_model_package_declares_its_cann_recipes_names():
    for package in MODELS.glob("*/__init__.py"):
        assert "model_names" in package.read_text(), package
