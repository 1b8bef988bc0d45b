"""Model families live in models/ alone: no file under executor/ names one, and the Qwen families are
Llama subclasses that say which cann-recipes model names they serve."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from models.llama import LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = (
    "llama", "smollm", "qwen", "deepseek", "gpt[-_ ]?oss", "mistral", "mixtral", "kimi", "glm", "gemma", "longcat",
    "bailing", "pangu", "hunyuan",
)  # fmt: skip
MODEL_FOLDERS = tuple(re.escape(p.parent.name) for p in (ROOT / "models").glob("*/__init__.py"))
# A family name where a word starts ("qwen3_moe", "DeepSeek's", "models.llama"), in any case.
FAMILY_NAME = re.compile(rf"(?<![a-z])({'|'.join(FAMILIES + MODEL_FOLDERS)})", re.IGNORECASE)


def test_the_family_pattern_finds_names_in_code_and_prose():
    for text in ('model_name = "llama"', "from models.qwen3_moe import", "DeepSeek's router", "GPT-OSS", "Kimi-K2"):
        assert FAMILY_NAME.search(text), text
    for text in ("ollama", "the default model", "gpt2 tokenizer"):
        assert not FAMILY_NAME.search(text), text


def test_no_file_under_executor_names_a_model_family():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "executor").rglob("*"))
        if path.is_file() and path.suffix in (".py", ".sh", ".md", ".yaml")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if FAMILY_NAME.search(line)
    ]
    assert hits == []


@pytest.mark.parametrize(
    ("family", "model_names"),
    [("qwen2", ("qwen25_7b_instruct",)), ("qwen3", ("qwen3_8b",)), ("qwen3_moe", ("qwen3_moe",))],
)
def test_qwen_packages_subclass_llama_and_name_their_cann_recipes_models(family, model_names):
    package = importlib.import_module(f"models.{family}")
    assert package.model_names == model_names
    assert issubclass(package.model_cls, LlamaForCausalLM)
    assert package.config_cls.model_type == family
