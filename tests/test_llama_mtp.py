"""The Llama MTP layer (module/mtp.py) against a plain-torch reference on the same weights, and the script
that trains one (scripts/train_mtp_head.py).

The reference runs each sequence alone: RMSNorms and eh_proj written out here, transformers' own Llama
decoder layer (causal), shared_head.norm and the LM head. Ours runs the sequences packed over
NaN-filled paged KV caches, reading the hidden states of our main model's forward().
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers.models.llama.modeling_llama import LlamaDecoderLayer as HFDecoderLayer

from executor.model_loader.default_loader import DefaultModelLoader
from executor.offline.dataset import load_prompts
from executor.types_.errors import WeightLoadError
from models.llama import LlamaForCausalLM
from module.attention import Attention
from ops.attention.metadata import ScheduledSequence, TorchMetadataBuilder, build_model_inputs, build_step_layout
from scripts import train_mtp_head
from scripts.train_mtp_head import (
    Sequence,
    TrainableMTPLayer,
    generate_token_ids,
    load_frozen_model,
    mtp_hidden_states,
    with_hidden_states,
)
from tests.backends import cpu_backend
from tests.conftest import save_tiny_llama
from tests.engine_harness import run_engine
from tests.factories import TINY_VOCAB, llama_config, mtp_config
from tests.paged_harness import random_prompts, single_thread  # noqa: F401 (single_thread: an autouse fixture)

NUM_LAYERS = 3  # llama_config's; the MTP layer's checkpoint index
BLOCK_SIZE = 4
NUM_BLOCKS = 64
SEQUENCE_LENGTHS = [6, 13, 2, 9]


def random_mtp_tensors(config: transformers.LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """An MTP layer in DeepSeek's checkpoint names, norms away from 1 so that each one matters."""
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    torch.manual_seed(seed)
    tensors = {f"mtp_block.{name}": t for name, t in HFDecoderLayer(config, NUM_LAYERS).state_dict().items()}
    tensors["eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.1
    for norm in (
        "enorm",
        "hnorm",
        "shared_head.norm",
        "mtp_block.input_layernorm",
        "mtp_block.post_attention_layernorm",
    ):
        tensors[f"{norm}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=generator)
    prefix = f"model.layers.{NUM_LAYERS}."
    return {prefix + name.removeprefix("mtp_block."): tensor for name, tensor in tensors.items()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def reference_mtp(
    hf_model: torch.nn.Module, mtp: dict[str, torch.Tensor], token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows j = 0 .. L-2 (token t_{j+1}, the target's final hidden state h_j, position j) of one sequence
    alone: (hidden states before shared_head.norm, logits)."""
    config = hf_model.config
    eps, prefix = config.rms_norm_eps, f"model.layers.{NUM_LAYERS}."
    tokens = torch.tensor([token_ids])
    target_hidden = hf_model.model(tokens).last_hidden_state[:, :-1]
    embeds = hf_model.model.embed_tokens(tokens[:, 1:])
    mixed = torch.cat(
        [
            rms_norm(embeds, mtp[prefix + "enorm.weight"], eps),
            rms_norm(target_hidden, mtp[prefix + "hnorm.weight"], eps),
        ],
        dim=-1,
    )
    hidden = mixed @ mtp[prefix + "eh_proj.weight"].T
    block = HFDecoderLayer(config, NUM_LAYERS).eval()
    block.load_state_dict({name: mtp[prefix + name] for name in block.state_dict()})
    num_rows = hidden.shape[1]
    causal_mask = torch.full((num_rows, num_rows), float("-inf")).triu(1)[None, None]
    rotary = hf_model.model.rotary_emb(hidden, torch.arange(num_rows)[None])
    hidden = block(hidden, attention_mask=causal_mask, position_embeddings=rotary)
    logits = hf_model.lm_head(rms_norm(hidden, mtp[prefix + "shared_head.norm.weight"], eps))
    return hidden, logits


class PagedMTPLlama:
    """Our model with an MTP layer, every layer on its own NaN-filled paged cache, driven step by step."""

    def __init__(self, config: transformers.LlamaConfig, hf_model: torch.nn.Module, mtp: dict[str, torch.Tensor]):
        self.model = LlamaForCausalLM(config, backend=cpu_backend())
        filled = self.model.load_weights([*hf_model.state_dict().items(), *mtp.items()])
        assert filled == {name for name, _ in self.model.named_parameters()}
        head_dim = config.hidden_size // config.num_attention_heads
        for attention in (m for m in self.model.modules() if isinstance(m, Attention)):
            shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, head_dim)
            attention.bind_kv_cache(
                {"key": torch.full(shape, float("nan")), "value": torch.full(shape, float("nan"))}, 0
            )
        self.max_blocks = -(-config.max_position_embeddings // BLOCK_SIZE)
        self.free_blocks = random.Random(0).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)

    def allocate(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // BLOCK_SIZE)
        blocks, self.free_blocks = self.free_blocks[:count], self.free_blocks[count:]
        return blocks

    def inputs(self, sequences: list[ScheduledSequence]):
        layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=self.max_blocks)
        return build_model_inputs(layout, TorchMetadataBuilder(torch.device("cpu")))

    @torch.no_grad()
    def target_hidden(self, prompts: list[list[int]], blocks: list[list[int]]) -> list[torch.Tensor]:
        """The main model's forward() over each whole prompt, packed: [len(prompt), hidden] each."""
        inputs = self.inputs([ScheduledSequence(p, 0, [b]) for p, b in zip(prompts, blocks, strict=True)])
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
        return list(hidden.split([len(p) for p in prompts]))

    @torch.no_grad()
    def mtp_step(
        self, token_ids: list[list[int]], previous: list[torch.Tensor], starts: list[int], blocks: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP rows of each sequence from its row `start` on (the earlier rows already in the MTP cache):
        (hidden states, logits of every row)."""
        sequences = [
            ScheduledSequence(ids, start, [b], num_sampled_rows=len(ids))
            for ids, start, b in zip(token_ids, starts, blocks, strict=True)
        ]
        inputs = self.inputs(sequences)
        hidden = self.model.mtp_forward(
            0, inputs.input_ids, inputs.positions, torch.cat(previous), inputs.forward_metadata
        )
        return hidden, self.model.mtp_compute_logits(0, hidden, inputs.logits_indices)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, dict[str, torch.Tensor], PagedMTPLlama]:
    config = mtp_config()
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    mtp = random_mtp_tensors(config, seed=1)
    return hf_model, mtp, PagedMTPLlama(config, hf_model, mtp)


def test_packed_mtp_prefill_matches_reference_per_sequence(models):
    hf_model, mtp, ours = models
    sequences = random_prompts(SEQUENCE_LENGTHS, seed=2)
    blocks = [ours.allocate(len(s)) for s in sequences]
    target_hidden = ours.target_hidden(sequences, blocks)
    hidden, logits = ours.mtp_step(
        [s[1:] for s in sequences], [h[:-1] for h in target_hidden], [0] * len(sequences), blocks
    )
    assert logits.shape == (sum(SEQUENCE_LENGTHS) - len(SEQUENCE_LENGTHS), TINY_VOCAB)
    num_rows = [len(s) - 1 for s in sequences]
    for sequence, our_hidden, our_logits in zip(sequences, hidden.split(num_rows), logits.split(num_rows), strict=True):
        expected_hidden, expected_logits = reference_mtp(hf_model, mtp, sequence)
        assert (our_hidden - expected_hidden[0]).abs().max() <= 1e-4
        assert (our_logits - expected_logits[0]).abs().max() <= 1e-4


def test_mtp_rows_after_cached_rows_match_reference(models):
    """A later step's rows (one, as after a decode step, or several, as after a verify step) attend to the rows
    the MTP cached before."""
    hf_model, mtp, ours = models
    sequences = random_prompts([6, 13, 3, 9], seed=3)
    splits = [4, 9, 1, 5]  # rows cached first; 1, 3, 1 and 3 rows follow
    blocks = [ours.allocate(len(s)) for s in sequences]
    target_hidden = ours.target_hidden(sequences, blocks)
    pairs = list(zip(sequences, target_hidden, splits, strict=True))
    ours.mtp_step([s[1 : k + 1] for s, _, k in pairs], [h[:k] for _, h, k in pairs], [0] * len(pairs), blocks)
    _, logits = ours.mtp_step([s[k + 1 :] for s, _, k in pairs], [h[k:-1] for _, h, k in pairs], splits, blocks)
    num_rows = [len(s) - 1 - k for s, k in zip(sequences, splits, strict=True)]
    for sequence, k, our_logits in zip(sequences, splits, logits.split(num_rows), strict=True):
        assert (our_logits - reference_mtp(hf_model, mtp, sequence)[1][0, k:]).abs().max() <= 1e-4


def test_copies_of_shared_tensors_in_mtp_layers_are_skipped(models):
    hf_model, mtp, _ = models
    model = LlamaForCausalLM(mtp_config(), backend=cpu_backend())
    copies = {
        f"model.layers.{NUM_LAYERS}.embed_tokens.weight": torch.zeros(TINY_VOCAB, 64),
        f"model.layers.{NUM_LAYERS}.shared_head.head.weight": torch.zeros(TINY_VOCAB, 64),
    }
    filled = model.load_weights([*hf_model.state_dict().items(), *mtp.items(), *copies.items()])
    assert filled == {name for name, _ in model.named_parameters()}
    assert torch.equal(model.model.embed_tokens.weight, hf_model.model.embed_tokens.weight)


def test_mtp_layer_needs_its_checkpoint_tensors():
    model = LlamaForCausalLM(mtp_config(), backend=cpu_backend())
    state = transformers.LlamaForCausalLM(mtp_config()).state_dict()
    missing = {name for name, _ in model.named_parameters()} - model.load_weights(state.items())
    assert missing and all(name.startswith("mtp_layers.0.") for name in missing)
    assert "mtp_layers.0.self_attn.qkv_proj.weight" in missing


def test_without_the_config_key_there_is_no_mtp_layer_and_parameters_are_unchanged():
    plain = LlamaForCausalLM(llama_config(), backend=cpu_backend())
    assert plain.num_mtp_layers == 0
    assert list(plain.state_dict()) == list(
        LlamaForCausalLM(llama_config(num_nextn_predict_layers=0), backend=cpu_backend()).state_dict()
    )
    assert not any("mtp" in name for name, _ in plain.named_parameters())


def test_mtp_tensor_without_an_mtp_layer_is_named():
    model = LlamaForCausalLM(llama_config(), backend=cpu_backend())
    with pytest.raises(WeightLoadError, match=f"model.layers.{NUM_LAYERS}.enorm.weight"):
        model.load_weights([(f"model.layers.{NUM_LAYERS}.enorm.weight", torch.ones(64))])


@pytest.mark.parametrize("value", [-1, 1.5, "1"])
def test_bad_num_nextn_predict_layers_is_refused(value):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LlamaForCausalLM(llama_config(num_nextn_predict_layers=value), backend=cpu_backend())


def test_training_module_exports_what_the_reference_computes():
    """The script trains transformers' modules; under DeepSeek's names its weights give the reference's logits,
    which our mtp_forward matches (above)."""
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(mtp_config()).eval()
    mtp = TrainableMTPLayer(hf_model)
    with torch.no_grad():
        for param in mtp.parameters():  # away from the initial pass-through, so that every weight matters
            param.add_(0.1 * torch.randn_like(param))
        tokens = random_prompts([11], seed=4)[0]
        target_hidden = hf_model.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
        sequence = Sequence(torch.tensor(tokens), 4, target_hidden)
        logits = hf_model.lm_head(mtp_hidden_states(hf_model, mtp, sequence, slice(0, 10)))
    expected = reference_mtp(hf_model, mtp.checkpoint_tensors(NUM_LAYERS), tokens)[1][0]
    assert (logits - expected).abs().max() <= 1e-4


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    """Prompts of different lengths, so that generation batches pad some of them."""
    words = [" ".join(f"w{3 + (i * 7 + j) % 250}" for j in range(length)) for i, length in enumerate([3, 17, 1, 8])]
    records = [{"prompt": text} for text in words] + [{"messages": [{"role": "user", "content": "w9 w10"}]}]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_generation_keeps_the_greedy_tokens_and_each_tokens_hidden_states(tiny_llama_dir, prompt_file):
    """The engine's greedy tokens are transformers' on each prompt alone; the padded batched forward gives
    each sequence's own final hidden states and the chosen layers' inputs, as one forward over it alone."""
    model = load_frozen_model(tiny_llama_dir)
    sequences = with_hidden_states(
        model, generate_token_ids(tiny_llama_dir, [prompt_file], max_new_tokens=12), aux_layers=(0, 1)
    )
    assert len(sequences) == 5 and len({len(s.token_ids) for s in sequences}) > 1  # batches are padded
    with torch.no_grad():
        for sequence in sequences:
            prompt = sequence.token_ids[: sequence.num_prompt_tokens]
            alone = model.generate(prompt[None], do_sample=False, max_new_tokens=12)[0, len(prompt) :]
            assert sequence.token_ids[len(prompt) :].tolist() == alone.tolist()
            output = model.model(sequence.token_ids[None, :-1], output_hidden_states=True)
            assert (sequence.hidden_states - output.last_hidden_state[0]).abs().max() <= 1e-4
            aux = torch.cat([output.hidden_states[0][0], output.hidden_states[1][0]], dim=-1)
            assert (sequence.aux_hidden_states - aux).abs().max() <= 1e-4


def test_script_saves_a_model_folder_that_loads_and_runs_as_before(tiny_llama_dir, prompt_file, tmp_path):
    output = tmp_path / "tiny-MTP"
    args = ["--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(output)]
    record = train_mtp_head.main([*args, "--steps", "2", "--max-new-tokens", "8"])
    assert record["held_out_rows"] > 0 and 0 <= record["held_out_draft1_top1_accuracy"] <= 1
    assert json.loads((output / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert {"tokenizer.json", "tokenizer_config.json", "mtp_training.json"} <= {p.name for p in output.iterdir()}
    assert (output / "model.safetensors").stat().st_ino == (tiny_llama_dir / "model.safetensors").stat().st_ino
    model = LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(output), backend=cpu_backend())
    DefaultModelLoader().load_weights(model, str(output))  # raises if any parameter is left unfilled
    num_layers = model.config.num_hidden_layers
    with safe_open(str(output / "mtp.safetensors"), framework="pt") as file:
        assert torch.equal(
            model.mtp_layers[0].eh_proj.weight, file.get_tensor(f"model.layers.{num_layers}.eh_proj.weight")
        )
    # Without next_n the engine never calls the MTP layer: the folder generates what the model alone does.
    records = load_prompts(prompt_file)[:4]
    with_mtp = [request.output_token_ids for request in run_engine(output, records).requests]
    assert with_mtp == [request.output_token_ids for request in run_engine(tiny_llama_dir, records).requests]


def test_both_training_scripts_read_the_sequences_either_one_generated(prompt_file, tmp_path, monkeypatch):
    from scripts import train_eagle3

    model_dir = save_tiny_llama(tmp_path / "tiny", num_hidden_layers=6)  # EAGLE-3 reads three layers
    cache = tmp_path / "sequences.pt"
    args = ["--model", str(model_dir), "--prompts", str(prompt_file), "--sequences", str(cache), "--steps", "2"]
    first = train_mtp_head.main([*args, "--max-new-tokens", "8", "--output", str(tmp_path / "mtp")])
    assert cache.is_file()

    def generate_again(*_args: object) -> None:
        raise AssertionError("generated again despite --sequences")

    monkeypatch.setattr(train_mtp_head, "generate_token_ids", generate_again)
    again = train_mtp_head.main([*args, "--max-new-tokens", "8", "--output", str(tmp_path / "mtp")])
    times = ("generate_s", "total_s")
    assert {k: v for k, v in again.items() if k not in times} == {k: v for k, v in first.items() if k not in times}
    eagle3 = train_eagle3.main([*args, "--max-new-tokens", "8", "--output", str(tmp_path / "eagle3")])
    assert eagle3["training_sequences"] + eagle3["held_out_sequences"] == 5 and eagle3["held_out_chains"] > 0
    # --init trains on from that drafter: before its first step it accepts what the drafter accepted
    # (its weights and its draft vocabulary, not one the new run would choose: --draft-vocab 16 here)
    more = ["--max-new-tokens", "8", "--draft-vocab", "16", "--output", str(tmp_path / "eagle3-more")]
    again = train_eagle3.main([*args, *more, "--init", str(tmp_path / "eagle3")])
    assert again["held_out_accept_rate_by_position_at_init"] == eagle3["held_out_accept_rate_by_position"]
    assert again["draft_vocab_size"] == eagle3["draft_vocab_size"] != 16 and again["init"] == eagle3
    with pytest.raises(SystemExit, match="holds sequences of another model, prompt files or --max-new-tokens"):
        train_mtp_head.main([*args, "--max-new-tokens", "9", "--output", str(tmp_path / "mtp")])


def test_script_refuses_to_replace_a_folder_it_did_not_write(tiny_llama_dir, prompt_file):
    args = ["--model", str(tiny_llama_dir), "--prompts", str(prompt_file), "--output", str(tiny_llama_dir)]
    with pytest.raises(SystemExit, match="is not a folder this script wrote"):
        train_mtp_head.main(args)
    assert (tiny_llama_dir / "model.safetensors").is_file()
