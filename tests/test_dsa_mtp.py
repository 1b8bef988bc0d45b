"""DeepSeek-V3.2's and GLM-5's MTP modules (DeepSeek-V3's path, module/mtp.py) on the paged path
against tests/test_deepseek_v3_mtp.py's direct reference: the checkpoint's MTP tensors applied with
plain torch to whole sequences, each module's decoder block (with an indexer of its own, here
selecting 6 of up to 12 tokens) run as transformers' decoder layer with a causal mask; and MTP
speculative decoding through the engine gives the greedy output."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from models.deepseek_v3_2 import DeepseekV32ForCausalLM
from models.glm_5 import GlmMoeDsaForCausalLM
from module.dsa import SparseMLAAttention
from ops.attention.metadata import ScheduledSequence
from tests import paged_harness
from tests.deepseek_v3_harness import save_checkpoint
from tests.engine_harness import ENGINE_CONFIG, make_inference, token_records
from tests.factories import dsa_config, tiny_tokenizer
from tests.paged_harness import (
    PagedModel,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)
from tests.test_deepseek_v3_mtp import BLOCK_SIZE, NUM_MTP, PROMPT_LENS, TOLERANCE, paged_chain, reference_chain

# family -> (transformers' class, ours, overrides: GLM-5 with IndexShare, its MTP layers full all the same)
FAMILIES = {
    "deepseek_v32": (transformers.DeepseekV32ForCausalLM, DeepseekV32ForCausalLM, {}),
    "glm_moe_dsa": (transformers.GlmMoeDsaForCausalLM, GlmMoeDsaForCausalLM, {"index_topk_pattern": "FFS"}),
}


class HiddenOnly(torch.nn.Module):
    """A transformers GLM-5 decoder layer that returns its hidden states alone, as DeepSeek-V3.2's does."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.layer(*args, **kwargs)[0]


@pytest.fixture(params=list(FAMILIES), scope="module")
def setup(request, tmp_path_factory):
    hf_cls, ours_cls, overrides = FAMILIES[request.param]
    config = dsa_config(request.param, num_nextn_predict_layers=NUM_MTP, **overrides)
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    hf_model = save_checkpoint(path, config, hf_model_cls=hf_cls)
    if request.param == "glm_moe_dsa":  # its layers return (hidden, selection); the reference takes hidden
        layers = hf_model.model.layers
        for index in range(config.num_hidden_layers, len(layers)):
            layers[index] = HiddenOnly(layers[index])
    checkpoint = load_file(str(path / "model.safetensors"))
    return hf_model, checkpoint, PagedModel(paged_harness.load_ours(ours_cls, path, config), BLOCK_SIZE)


def test_every_mtp_module_runs_an_indexer_of_its_own(setup):
    _, _, ours = setup
    model = ours.model
    assert model.num_mtp_layers == NUM_MTP
    for layer in range(NUM_MTP):
        attention = model.mtp_layer(layer).self_attn
        assert isinstance(attention, SparseMLAAttention) and attention.indexer is not None


def test_mtp_prefill_and_decode_match_the_direct_reference(setup):
    hf_model, checkpoint, ours = setup
    tokens = random_prompts([n + NUM_MTP + 1 for n in PROMPT_LENS], seed=7)
    blocks = [ours.allocate(n + 1) for n in PROMPT_LENS]
    prefill = [ScheduledSequence(t[:n], 0, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    decode = [ScheduledSequence([t[n]], n, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]

    start = 0
    prefill_outputs = paged_chain(ours, prefill, tokens)
    for request_tokens, seq_len in zip(tokens, PROMPT_LENS, strict=True):
        expected = reference_chain(hf_model, checkpoint, request_tokens, seq_len)
        for (hidden, logits), (ref_hidden, ref_logits) in zip(prefill_outputs, expected, strict=True):
            assert (hidden[start : start + seq_len] - ref_hidden).abs().max() <= TOLERANCE
            assert (logits[start : start + seq_len] - ref_logits).abs().max() <= TOLERANCE
        start += seq_len

    decode_outputs = paged_chain(ours, decode, tokens)
    for row, (request_tokens, seq_len) in enumerate(zip(tokens, PROMPT_LENS, strict=True)):
        expected = reference_chain(hf_model, checkpoint, request_tokens, seq_len + 1)
        for (hidden, logits), (ref_hidden, ref_logits) in zip(decode_outputs, expected, strict=True):
            assert (hidden[row] - ref_hidden[-1]).abs().max() <= TOLERANCE
            assert (logits[row] - ref_logits[-1]).abs().max() <= TOLERANCE


def speculative_greedy(path, model_name: str, next_n: int) -> tuple[list[list[int]], dict]:
    """The engine's greedy outputs with next_n MTP drafts per step (0: none), prompts of 33 and 40
    tokens prefilled in chunks, over the indexer's selection in every verify step."""
    records = token_records(random_prompts([1, 5, 17, 33, 8, 40, 3], seed=5))
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 6 + 4 * index
    inference = make_inference(
        path,
        model_config={"model_name": model_name, "next_n": next_n},
        batch_size=4,
        max_prefill_tokens=24,
        max_new_tokens=40,
    )
    result = inference.generate(records)
    return [r.output_token_ids for r in result.requests], result.summary


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mtp_speculation_gives_the_greedy_output(family, tmp_path):
    hf_cls, _, overrides = FAMILIES[family]
    config = dsa_config(family, num_nextn_predict_layers=1, **ENGINE_CONFIG, **overrides)
    save_checkpoint(tmp_path, config, hf_model_cls=hf_cls)
    tiny_tokenizer().save_pretrained(tmp_path)
    model_name = {"deepseek_v32": "deepseek_v3_2_exp", "glm_moe_dsa": "glm_5"}[family]
    expected, _ = speculative_greedy(tmp_path, model_name, 0)
    outputs, summary = speculative_greedy(tmp_path, model_name, 1)
    assert outputs == expected
    assert summary["speculative"]["draft_tokens"] > 0
