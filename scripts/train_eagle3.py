"""Train an EAGLE-3 drafter (models/llama/eagle3.py) for a Llama model on its own greedy outputs, on CPU.

    PYTHONPATH=. .venv/bin/python scripts/train_eagle3.py [--model DIR] [--prompts FILE ...] [--steps N]
        [--depth K] [--draft-vocab N] [--output DIR] [--sequences FILE]

1. The engine generates the model's greedy continuations of the prompts (as scripts/train_mtp_head.py
   does: fp32, chat template); one batched transformers forward over them keeps the final hidden
   states and the residual stream at the three layers the drafter reads (vLLM's default: the inputs
   of layers 2, L // 2 and L - 3).
2. The draft vocabulary is the `--draft-vocab` tokens most frequent in those sequences (d2t maps
   them back; EAGLE-3's reduced vocabulary, which makes each draft's LM head that much cheaper).
3. The drafter learns with EAGLE-3's training-time test: each sequence is unrolled `--depth` steps
   of the chain the proposer drafts with. Step 0, row j reads (fc(the three hidden states at j),
   t_{j+1}); step s, row j reads the hidden state step s - 1 gave at row j and t_{j+1+s} at position
   j + s, attending to step 0's rows up to j and its own chain's earlier steps; each learns the
   target's next-token distribution after its token (restricted to the draft vocabulary), step s's
   loss weighted 0.8^s. The decoder layer starts as a copy of the target's last one (q/k/v read the
   embedding half and the hidden half alike), fc as the high layer alone, its LM head as the
   target's rows.
4. Held-out sequences give the expected greedy accept rate at each draft position (the share of
   chains whose drafts 1..s are all the model's tokens, as summary.json counts it). The output
   folder is in the layout vLLM's eagle3 method loads: config.json (architectures
   [LlamaForCausalLMEagle3], draft_vocab_size), model.safetensors (midlayer.*, fc, norm, lm_head,
   d2t, t2d) and eagle3_training.json with the figures.
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
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DatasetError
from executor.utils.logging_config import setup_logging
from models.llama.eagle3 import aux_hidden_state_layers
from scripts.train_mtp_head import (
    Sequence,
    cached_sequences,
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

    def forward(self, model: nn.Module, token_ids: torch.Tensor, aux: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test over one sequence, unrolled `depth` steps: step 0 row j (j = 0 ..
        L-2) reads t_{j+1} and fc(aux_j) at position j; step s row j is draft s + 1 of the chain that
        starts after row j, as the proposer runs it: t_{j+1+s} at position j + s, the hidden state step
        s - 1 gave at row j, attending to step 0's rows 0..j and to its own chain's rows of steps 1..s.
        -> per step, logits [L-1, draft vocab] (rows past the sequence's end read its last token)."""
        layer = self.midlayer
        rows = torch.arange(aux.shape[0])
        hidden = self.fc(aux)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        logits = []
        for step in range(depth):
            embeds = model.model.embed_tokens(token_ids[(rows + 1 + step).clamp(max=len(token_ids) - 1)])
            mixed = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
            cos, sin = model.model.rotary_emb(hidden[None], (rows + step)[None])
            query, key, value = self._project(mixed, cos, sin)
            keys.append(key)
            values.append(value)
            residual = hidden + layer.self_attn.o_proj(self._attend(query, keys, values))
            hidden = layer.mlp(layer.post_attention_layernorm(residual)) + residual
            logits.append(self.lm_head(self.norm(hidden)))
        return logits

    def _project(
        self, mixed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N, 2 x hidden] -> roped q [heads, N, D], roped k and v [kv heads, N, D]."""
        attention = self.midlayer.self_attn
        query, key, value = (
            projection(mixed).view(mixed.shape[0], -1, attention.head_dim).transpose(0, 1)
            for projection in (attention.q_proj, attention.k_proj, attention.v_proj)
        )
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin, value

    def _attend(self, query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Row j of the latest step over step 0's rows 0..j (causal) and row j of every later step
        (its chain's own earlier drafts) -> [N, heads x D]."""
        groups = query.shape[0] // keys[0].shape[0]
        keys = [key.repeat_interleave(groups, dim=0) for key in keys]
        values = [value.repeat_interleave(groups, dim=0) for value in values]
        scale = self.midlayer.self_attn.scaling
        num_rows = query.shape[1]
        causal = torch.full((num_rows, num_rows), float("-inf")).triu(1)
        scores = [query @ keys[0].transpose(1, 2) * scale + causal]
        scores += [(query * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
        probs = torch.cat(scores, dim=-1).softmax(-1)
        output = probs[..., :num_rows] @ values[0]
        for index, value in enumerate(values[1:]):
            output = output + probs[..., num_rows + index, None] * value
        return output.transpose(0, 1).flatten(1)

    @classmethod
    def from_folder(cls, model: nn.Module, folder: Path) -> TrainableEagle3:
        """A drafter this script wrote, to train on: its weights and its draft vocabulary (d2t)."""
        tensors = load_file(str(folder / "model.safetensors"))
        d2t = tensors.pop("d2t")
        tensors.pop("t2d")
        tensors["draft_token_ids"] = d2t + torch.arange(len(d2t))
        drafter = cls(model, tensors["draft_token_ids"])
        drafter.load_state_dict(tensors)
        return drafter

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


def draft_vocabulary(sequences: list[Sequence], size: int, vocab_size: int) -> torch.Tensor:
    """The `size` tokens most frequent in the sequences (ties by id), sorted: the draft vocabulary."""
    counts = Counter(token for sequence in sequences for token in sequence.token_ids.tolist())
    ranked = sorted(range(vocab_size), key=lambda token: (-counts.get(token, 0), token))
    return torch.tensor(sorted(ranked[:size]))


@torch.no_grad()
def target_logits(draft_head: torch.Tensor, sequence: Sequence) -> torch.Tensor:
    """[L - 2, draft vocab]: the model's logits after t_{j+1} (j = 0 .. L-3) over the draft vocabulary;
    step s, row j's target is the softmax of row j + s. `draft_head` is the LM head's rows of the draft
    vocabulary: the full head's 49,152 columns, once per step of the chain, were 45% of a training step's
    CPU time (SmolLM2, 270 tokens, depth 3)."""
    return F.linear(sequence.hidden_states[1:], draft_head)


def train(
    model: nn.Module,
    drafter: TrainableEagle3,
    data: list[tuple[Sequence, torch.Tensor]],
    args: argparse.Namespace,
) -> None:
    """AdamW, linear warm-up then cosine decay; each optimizer step one sequence unrolled args.depth
    steps, soft targets, step s's loss weighted 0.8^s (SpecForge's weights)."""
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = warmup_cosine(optimizer, args.steps)
    order = random.Random(args.seed)
    draft_head = model.lm_head.weight[drafter.draft_token_ids]
    drafter.train()
    with tqdm(range(args.steps), desc="train", unit="step") as progress:
        for _ in progress:
            sequence, aux = order.choice(data)
            teacher = target_logits(draft_head, sequence)
            losses = []
            for step, logits in enumerate(drafter(model, sequence.token_ids, aux, args.depth)):
                target = teacher[step:].softmax(-1)
                losses.append(0.8**step * F.cross_entropy(logits[: len(target)], target))
            loss = sum(losses)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.set_postfix(loss=f"{loss.item():.3f}")


@torch.no_grad()
def accept_rates(
    model: nn.Module, drafter: TrainableEagle3, data: list[tuple[Sequence, torch.Tensor]], depth: int
) -> tuple[list[float], int]:
    """The expected greedy accept rate at each draft position, as summary.json counts it: the share
    of the chains started in the generated part (row j predicts t_{j+2} first) whose drafts 1..s are
    all the model's own tokens; and the number of chains."""
    drafter.eval()
    accepted = [0] * depth
    total = 0
    for sequence, aux in data:
        num_tokens = len(sequence.token_ids)
        rows = torch.arange(max(sequence.num_prompt_tokens - 2, 0), num_tokens - 2)
        all_correct = torch.ones(len(rows), dtype=torch.bool)
        for step, logits in enumerate(drafter(model, sequence.token_ids, aux, depth)):
            expected_at = rows + 2 + step
            in_sequence = expected_at < num_tokens
            predicted = drafter.draft_token_ids[logits[rows].argmax(-1)]
            expected = sequence.token_ids[expected_at.clamp(max=num_tokens - 1)]
            all_correct &= in_sequence & (predicted == expected)
            accepted[step] += int(all_correct.sum())
        total += len(rows)
    return [count / max(total, 1) for count in accepted], total


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
    parser = training_arguments(__doc__.splitlines()[0], steps=4000, output_suffix="-EAGLE3")
    parser.add_argument("--draft-vocab", type=int, default=8192, help="tokens of the reduced draft vocabulary")
    parser.add_argument("--depth", type=int, default=3, help="chain steps unrolled in training (training-time test)")
    parser.add_argument(
        "--init",
        type=Path,
        default=None,
        help="a drafter folder this script wrote: train on from its weights and "
        "draft vocabulary (--draft-vocab is then its size)",
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.draft_vocab, args.depth) < 1 or args.max_new_tokens < 2 or not 0 < args.held_out < 1:
        parser.error(
            "--steps, --draft-vocab and --depth must be >= 1, --max-new-tokens >= 2 and --held-out between 0 and 1"
        )
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
        layers = aux_hidden_state_layers(model.config, model.config.num_hidden_layers)
        try:
            sequences = cached_sequences(model, model_dir, args.prompts, args.max_new_tokens, args.sequences, layers)
        except DatasetError as error:
            raise SystemExit(f"train_eagle3: {error}") from None
        data = [(s, s.aux_hidden_states) for s in sequences if len(s.token_ids) - s.num_prompt_tokens >= 2]
        random.Random(args.seed).shuffle(data)
        num_held_out = max(1, round(len(data) * args.held_out))
        held_out, training = data[:num_held_out], data[num_held_out:]
        if args.init is not None:
            drafter = TrainableEagle3.from_folder(model, args.init.expanduser().resolve())
        else:
            vocabulary = draft_vocabulary(
                [s for s, _ in training], min(args.draft_vocab, model.config.vocab_size), model.config.vocab_size
            )
            drafter = TrainableEagle3(model, vocabulary)
        rates_before, num_chains = accept_rates(model, drafter, held_out, args.depth)
        train(model, drafter, training, args)
        rates, _ = accept_rates(model, drafter, held_out, args.depth)
    record = {
        "held_out_accept_rate_by_position": [round(rate, 4) for rate in rates],
        "held_out_accept_rate_by_position_at_init": [round(rate, 4) for rate in rates_before],
        "held_out_chains": num_chains,
        "held_out_sequences": len(held_out),
        "training_sequences": len(training),
        "draft_vocab_size": len(drafter.draft_token_ids),
        "aux_hidden_state_layers": list(layers),
        "steps": args.steps,
        "depth": args.depth,
        "init": None if args.init is None else json.loads((args.init / TRAINING_RECORD_FILE).read_text()),
        "lr": args.lr,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "prompts": [p.name for p in args.prompts],
        "total_s": round(time.perf_counter() - start_s, 1),
    }
    save_folder(model, drafter, output, layers, record)
    logger.info(
        "held-out accept rate by draft position: %s over %d chains (%s before training); saved %s",
        record["held_out_accept_rate_by_position"], num_chains, record["held_out_accept_rate_by_position_at_init"],
        output,
    )  # fmt: skip
    return record


if __name__ == "__main__":
    main()
