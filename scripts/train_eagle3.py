"""Train an EAGLE-3 drafter (models/llama/eagle3.py) for a Llama model on its own greedy outputs, on CPU.

    PYTHONPATH=. .venv/bin/python scripts/train_eagle3.py [--model DIR] [--prompts FILE ...] [--steps N]
        [--draft-vocab N] [--output DIR]

1. transformers generates the model's greedy continuations of the prompts (as scripts/train_mtp_head.py
   does: fp32, chat template); one more forward per sequence keeps the residual stream at the three
   layers the drafter reads (vLLM's default: the inputs of layers 2, L // 2 and L - 3).
2. The draft vocabulary is the `--draft-vocab` tokens most frequent in those sequences (d2t maps
   them back; EAGLE-3's reduced vocabulary, which makes each draft's LM head that much cheaper).
3. The drafter learns, at each row j, the target's next-token distribution after t_{j+1} (restricted
   to the draft vocabulary) from (fc(the three hidden states at j), t_{j+1}): the first draft of a
   step. Its decoder layer starts as a copy of the target's last one (q/k/v read the embedding half
   and the hidden half alike), fc as the high layer alone, its LM head as the target's rows. Only
   this one-step objective is trained (EAGLE-3's training-time test, which unrolls the chain, is not).
4. Held-out sequences give the top-1 accuracy of draft 1 (the expected greedy accept rate at
   position 1). The output folder is in the layout vLLM's eagle3 method loads: config.json
   (architectures [LlamaForCausalLMEagle3], draft_vocab_size), model.safetensors (midlayer.*, fc,
   norm, lm_head, d2t, t2d) and eagle3_training.json with the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DatasetError
from executor.utils.logging_config import setup_logging
from models.llama.eagle3 import aux_hidden_state_layers
from scripts.train_mtp_head import (
    Sequence,
    generate_sequences,
    load_frozen_model,
    training_arguments,
    warmup_cosine,
)

logger = logging.getLogger("train_eagle3")

TRAINING_RECORD_FILE = "eagle3_training.json"


class TrainableEagle3(nn.Module):
    """The drafter in plain torch (transformers' Llama attention and MLP), under vLLM's names."""

    def __init__(self, model: nn.Module, draft_token_ids: torch.Tensor) -> None:
        super().__init__()
        config = model.config
        hidden = config.hidden_size
        self.midlayer = copy.deepcopy(model.model.layers[-1]).requires_grad_(True)
        attention = self.midlayer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # read [embedding, hidden]: both halves start as the layer's own
            old = getattr(attention, name)
            new = nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None)
            with torch.no_grad():
                new.weight.copy_(torch.cat([old.weight, old.weight], dim=1) / 2)
            setattr(attention, name, new)
        self.midlayer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
        self.norm = copy.deepcopy(model.model.norm).requires_grad_(True)
        self.lm_head = nn.Linear(hidden, len(draft_token_ids), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(model.lm_head.weight[draft_token_ids])
        self.register_buffer("draft_token_ids", draft_token_ids)

    def forward(self, model: nn.Module, token_ids: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """Rows j = 0 .. L-2 (t_{j+1}, fc(aux_j), position j) of one sequence, causal -> logits over
        the draft vocabulary."""
        layer = self.midlayer
        hidden = self.fc(aux)[None]
        embeds = model.model.embed_tokens(token_ids[1:])[None]
        positions = torch.arange(hidden.shape[1])[None]
        mixed = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        length = hidden.shape[1]
        causal = torch.full((length, length), float("-inf")).triu(1)[None, None]  # explicit: eager attention too
        rotary = model.model.rotary_emb(hidden, positions)
        attention, _ = layer.self_attn(mixed, position_embeddings=rotary, attention_mask=causal)
        residual = hidden + attention
        output = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(output))[0]

    def checkpoint_tensors(self, vocab_size: int) -> dict[str, torch.Tensor]:
        """vLLM's eagle3 names: midlayer.*, fc, norm, lm_head, d2t (offsets), t2d (a mask over the target vocab)."""
        tensors = {name: tensor.detach().clone().contiguous() for name, tensor in self.state_dict().items()}
        draft_token_ids = tensors.pop("draft_token_ids")
        tensors = {name: tensor for name, tensor in tensors.items() if "rotary_emb" not in name}
        tensors["d2t"] = draft_token_ids - torch.arange(len(draft_token_ids))
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[draft_token_ids] = True
        tensors["t2d"] = t2d
        return tensors


@torch.no_grad()
def aux_hidden_states(model: nn.Module, sequence: Sequence, layers: tuple[int, int, int]) -> torch.Tensor:
    """[L - 1, 3 x hidden]: the inputs of `layers` at every token but the last (HF's hidden_states[i])."""
    states = model(sequence.token_ids[None, :-1], output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0] for layer in layers], dim=-1)


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` tokens most frequent in the sequences (ties by id), sorted: the draft vocabulary."""
    counts = Counter(token for sequence in sequences for token in sequence.token_ids.tolist())
    ranked = sorted(range(vocab_size), key=lambda token: (-counts.get(token, 0), token))
    return torch.tensor(sorted(ranked[:size]))


def targets(model: nn.Module, sequence: Sequence, draft_token_ids: torch.Tensor) -> torch.Tensor:
    """Row j's target: the model's distribution after t_{j+1} over the draft vocabulary, renormalised."""
    with torch.no_grad():
        logits = model.lm_head(sequence.hidden_states[1:])[:, draft_token_ids]
    return logits.softmax(-1)


def train(
    model: nn.Module,
    drafter: TrainableEagle3,
    data: list[tuple[Sequence, torch.Tensor]],
    steps: int,
    lr: float,
    seed: int,
) -> None:
    """AdamW, linear warm-up then cosine decay; each step one sequence in one causal pass; soft targets."""
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    schedule = warmup_cosine(optimizer, steps)
    order = random.Random(seed)
    drafter.train()
    with tqdm(range(steps), desc="train", unit="step") as progress:
        for _ in progress:
            sequence, aux = order.choice(data)
            logits = drafter(model, sequence.token_ids, aux)
            loss = F.cross_entropy(logits[:-1], targets(model, sequence, drafter.draft_token_ids))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.set_postfix(loss=f"{loss.item():.3f}")


@torch.no_grad()
def draft_accuracy(
    model: nn.Module, drafter: TrainableEagle3, data: list[tuple[Sequence, torch.Tensor]]
) -> tuple[float, int]:
    """Top-1 accuracy of draft 1 (t_{j+2} from row j) over the generated part of each sequence."""
    drafter.eval()
    correct = total = 0
    for sequence, aux in data:
        rows = slice(max(sequence.num_prompt_tokens - 2, 0), len(sequence.token_ids) - 2)
        predicted = drafter.draft_token_ids[drafter(model, sequence.token_ids, aux).argmax(-1)][rows]
        expected = sequence.token_ids[rows.start + 2 : rows.stop + 2]
        correct += int((predicted == expected).sum())
        total += expected.numel()
    return correct / max(total, 1), total


def save_folder(
    model: nn.Module, drafter: TrainableEagle3, output: Path, layers: tuple[int, int, int], record: dict
) -> None:
    config = model.config
    draft_config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.hidden_size // config.num_attention_heads,
        "hidden_act": config.hidden_act,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_parameters": config.rope_parameters,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": len(drafter.draft_token_ids),
        "tie_word_embeddings": False,
        "attention_bias": config.attention_bias,
        "mlp_bias": config.mlp_bias,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers), "use_aux_hidden_state": True},
        "torch_dtype": "float32",
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(draft_config, indent=2) + "\n")
    save_file(drafter.checkpoint_tensors(config.vocab_size), str(output / "model.safetensors"))
    (output / TRAINING_RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = training_arguments(__doc__.splitlines()[0], steps=600, output_suffix="-EAGLE3")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="tokens of the reduced draft vocabulary")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.draft_vocab < 1 or args.max_new_tokens < 2 or not 0 < args.held_out < 1:
        parser.error("--steps and --draft-vocab must be >= 1, --max-new-tokens >= 2 and --held-out between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_logging()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = (args.model or default_model_path()).expanduser().resolve()
    output = (args.output or model_dir.with_name(model_dir.name + "-EAGLE3")).expanduser().resolve()
    if output.exists() and not (output / TRAINING_RECORD_FILE).is_file():
        raise SystemExit(f"train_eagle3: --output {output} exists and is not a folder this script wrote")
    start_s = time.perf_counter()
    with logging_redirect_tqdm():
        model = load_frozen_model(model_dir)
        try:
            sequences = generate_sequences(model, model_dir, args.prompts, args.max_new_tokens)
        except DatasetError as error:
            raise SystemExit(f"train_eagle3: {error}") from None
        sequences = [s for s in sequences if len(s.token_ids) - s.num_prompt_tokens >= 2]
        layers = aux_hidden_state_layers(model.config, model.config.num_hidden_layers)
        data = [(sequence, aux_hidden_states(model, sequence, layers)) for sequence in sequences]
        random.Random(args.seed).shuffle(data)
        num_held_out = max(1, round(len(data) * args.held_out))
        held_out, training = data[:num_held_out], data[num_held_out:]
        vocabulary = draft_vocabulary(
            [s for s, _ in training], min(args.draft_vocab, model.config.vocab_size), model.config.vocab_size
        )
        drafter = TrainableEagle3(model, vocabulary)
        accuracy_before, num_rows = draft_accuracy(model, drafter, held_out)
        train(model, drafter, training, args.steps, args.lr, args.seed)
        accuracy, _ = draft_accuracy(model, drafter, held_out)
    record = {
        "held_out_draft1_top1_accuracy": round(accuracy, 4),
        "held_out_draft1_top1_accuracy_at_init": round(accuracy_before, 4),
        "held_out_rows": num_rows,
        "held_out_sequences": len(held_out),
        "training_sequences": len(training),
        "draft_vocab_size": len(vocabulary),
        "aux_hidden_state_layers": list(layers),
        "steps": args.steps,
        "lr": args.lr,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "prompts": [p.name for p in args.prompts],
        "total_s": round(time.perf_counter() - start_s, 1),
    }
    save_folder(model, drafter, output, layers, record)
    logger.info(
        "held-out top-1 accuracy of draft 1: %.1f%% over %d rows (%.1f%% before training); saved %s",
        100 * accuracy, num_rows, 100 * accuracy_before, output,
    )  # fmt: skip
    return record


if __name__ == "__main__":
    main()
