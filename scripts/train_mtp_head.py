"""Train one MTP layer (module/mtp.py) for a Llama model on its own greedy outputs, on CPU, in minutes.

    PYTHONPATH=. .venv/bin/python scripts/train_mtp_head.py [--model DIR] [--prompts FILE ...] [--steps N]
        [--output DIR] [--sequences FILE]

1. The engine generates the model's greedy continuations of the prompts (fp32, chat template, batch 32; it
   equals transformers token for token in fp32 and is several times faster than its generate); one batched
   transformers forward over each sequence then gives every token's final hidden state h_i, which is what the
   engine's forward() returns and the MTP layer reads.
2. The MTP layer learns to predict t_{i+2} from (h_i, t_{i+1}) with cross-entropy, on the rows whose target is a
   generated token, i.e. the drafts a decode step makes; the embedding and the LM head stay frozen.
3. Held-out sequences give the top-1 accuracy of that prediction: the expected greedy accept rate of draft 1.
4. The output is a complete model folder beside the model: its config with `num_nextn_predict_layers: 1`, its
   tokenizer files, its weights (hard links), the MTP layer in mtp.safetensors, and an index over both.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from executor.core.config.inference_config import build_config
from executor.model_loader.default_loader import INDEX_FILE, checkpoint_shards
from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DATASET_DIR, DatasetError, load_prompts, tokenize_record
from executor.offline.offline_inference import OfflineInference
from executor.utils.logging_config import setup_logging

logger = logging.getLogger("train_mtp_head")

MTP_WEIGHTS_FILE = "mtp.safetensors"
TRAINING_RECORD_FILE = "mtp_training.json"
# Disjoint from default.jsonl, so that the benchmarks, which run that, measure prompts the head never saw.
DEFAULT_PROMPT_FILES = (DATASET_DIR / "spec_train.jsonl",)  # chat-like, as default.jsonl (models/llama/README.md)
GENERATE_BATCH_SIZE = 32
FORWARD_BATCH_SIZE = 8
GENERATE_MAX_MODEL_LEN = 2048  # a longer prompt fails alone (and is left out)


@dataclass(slots=True)
class Sequence:
    """A prompt and its greedy continuation, with the frozen model's final hidden state of every token but the last."""

    token_ids: torch.Tensor  # [L] prompt then continuation
    num_prompt_tokens: int
    hidden_states: torch.Tensor  # [L - 1, hidden]: h_0 .. h_{L-2}
    aux_hidden_states: torch.Tensor | None = None  # [L - 1, 3 x hidden]: EAGLE-3's three layers' inputs

    @property
    def draft_rows(self) -> slice:
        """MTP rows j (reading h_j and t_{j+1}) whose target t_{j+2} is a generated token after the first:
        the drafts of a decode step, from the one made right after prefill (j = prompt length - 1) on."""
        return slice(self.num_prompt_tokens - 1, len(self.token_ids) - 2)

    @property
    def training_rows(self) -> slice:
        """Every row j whose target, the model's distribution after t_{j+1}, is known: prompt rows too, where
        t_{j+1} is the user's text and the target still what the model would say next."""
        return slice(0, len(self.token_ids) - 2)

    @property
    def draft_targets(self) -> torch.Tensor:
        rows = self.draft_rows
        return self.token_ids[rows.start + 2 : rows.stop + 2]


class TrainableMTPLayer(nn.Module):
    """The MTP layer of module/mtp.py built from transformers' Llama modules, so that it trains with
    autograd; the same structure and, under `model.layers.{N}.`, the same tensor names as the checkpoint."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        config = model.config
        hidden_size, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = LlamaRMSNorm(hidden_size, eps=eps)
        self.hnorm = LlamaRMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        # Start from the model's last layer: it already reads the residual stream's space and writes what the
        # final norm and LM head turn into a next-token guess, so the layer starts near a working predictor, not
        # from noise, which matters when a CPU's few minutes give only a few thousand training tokens.
        self.mtp_block = copy.deepcopy(model.model.layers[-1])
        self.shared_head = nn.Module()
        self.shared_head.norm = copy.deepcopy(model.model.norm)  # the head expects its own norm's scale
        with torch.no_grad():
            # Start by passing the hidden state through, [embeds, hidden] -> hidden: of this, a random start and
            # embeds + hidden, it gave the best held-out accuracy in a short trial.
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, hidden_size:].copy_(torch.eye(hidden_size))
        self.requires_grad_(True)

    def forward(
        self, input_embeds: torch.Tensor, previous_hidden_states: torch.Tensor, rotary: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        """[1, L, hidden] each -> [1, L, hidden] before shared_head.norm; causal over the L rows."""
        mixed = torch.cat([self.enorm(input_embeds), self.hnorm(previous_hidden_states)], dim=-1)
        num_rows = mixed.shape[1]
        causal_mask = torch.full((num_rows, num_rows), float("-inf")).triu(1)[None, None]
        return self.mtp_block(self.eh_proj(mixed), attention_mask=causal_mask, position_embeddings=rotary)

    def checkpoint_tensors(self, layer_index: int) -> dict[str, torch.Tensor]:
        """DeepSeek's names: `model.layers.{N}.enorm.weight`, ..., and the decoder layer's own under the same prefix."""
        prefix = f"model.layers.{layer_index}."
        return {
            prefix + name.removeprefix("mtp_block."): tensor.detach().contiguous()
            for name, tensor in self.state_dict().items()
        }


def load_frozen_model(model_dir: Path) -> nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def mtp_hidden_states(model: nn.Module, mtp: TrainableMTPLayer, sequence: Sequence, rows: slice) -> torch.Tensor:
    """MTP rows j = 0 .. L-2 read t_{j+1} and h_j at position j; returns shared_head.norm of `rows`."""
    input_embeds = model.model.embed_tokens(sequence.token_ids[1:])[None]
    previous = sequence.hidden_states[None]
    positions = torch.arange(previous.shape[1])[None]
    hidden_states = mtp(input_embeds, previous, model.model.rotary_emb(previous, positions))
    return mtp.shared_head.norm(hidden_states[0, rows])


def generate_token_ids(model_dir: Path, prompt_files: list[Path], max_new_tokens: int) -> list[tuple[list[int], int]]:
    """Greedy continuations of every prompt (chat template, fp32, ending at EOS, which is kept) by this
    project's engine at batch 32: 285 output tokens/s on two Zen 2 cores, where transformers' left-padded
    generate made 53 (on a busier day); the engine's greedy tokens are transformers' in fp32 (the parity
    tests). -> (token ids, prompt length)."""
    records = [record for path in prompt_files for record in load_prompts(path)]
    for record in records:
        if record.error is not None:
            logger.warning("skipping %s: %s", record.where, record.error)
    records = [record for record in records if record.error is None]
    max_position_embeddings = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    config = build_config(
        {
            "model_config": {"model_path": str(model_dir), "dtype": "float32"},
            "data_config": {"apply_chat_template": True, "input_truncated_len": 0},
            # the KV cache is sized for a full batch of max_model_len: the model's 8,192 would take 12 GB
            "scheduler_config": {
                "batch_size": GENERATE_BATCH_SIZE,
                "max_new_tokens": max_new_tokens,
                "max_model_len": min(GENERATE_MAX_MODEL_LEN, max_position_embeddings),
            },
        },
        source="train_mtp_head",
    )
    inference = OfflineInference(config, str(model_dir))
    prompts = [tokenize_record(record, inference.tokenizer, apply_chat_template=True) for record in records]
    result = inference.generate(records)
    pairs = zip(prompts, result.requests, strict=True)
    return [(prompt + request.output_token_ids, len(prompt)) for prompt, request in pairs]


@torch.no_grad()
def with_hidden_states(
    model: nn.Module, token_ids: list[tuple[list[int], int]], aux_layers: tuple[int, ...] = ()
) -> list[Sequence]:
    """The frozen model's final hidden state of every token but the last, and the inputs of `aux_layers`
    (EAGLE-3's residual stream), in right-padded batches of similar lengths (causal: padding after a
    sequence changes none of its rows)."""
    order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i][0]))
    sequences: dict[int, Sequence] = {}
    for start in tqdm(range(0, len(order), FORWARD_BATCH_SIZE), desc="hidden states", unit="batch"):
        batch = order[start : start + FORWARD_BATCH_SIZE]
        width = max(len(token_ids[i][0]) for i in batch) - 1
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            fed = token_ids[i][0][:-1]
            inputs[row, : len(fed)] = torch.tensor(fed)
            mask[row, : len(fed)] = 1
        output = model.model(inputs, attention_mask=mask, output_hidden_states=bool(aux_layers))
        for row, i in enumerate(batch):
            ids, num_prompt_tokens = token_ids[i]
            fed = len(ids) - 1
            aux = (
                torch.cat([output.hidden_states[layer][row, :fed] for layer in aux_layers], dim=-1).clone()
                if aux_layers
                else None
            )
            sequences[i] = Sequence(
                torch.tensor(ids), num_prompt_tokens, output.last_hidden_state[row, :fed].clone(), aux
            )
    return [sequences[i] for i in range(len(token_ids))]


def cached_sequences(
    model: nn.Module,
    model_dir: Path,
    prompt_files: list[Path],
    max_new_tokens: int,
    cache: Path | None,
    aux_layers: tuple[int, ...] = (),
) -> list[Sequence]:
    """generate_token_ids, read from `cache` when it was written for the same model, prompt files and
    max_new_tokens, else generated and written there (the MTP head and the EAGLE-3 drafter,
    train_eagle3.py, train on the same sequences); then with_hidden_states."""
    key = {
        "model": str(model_dir),
        "prompts": [hashlib.sha256(path.read_bytes()).hexdigest() for path in prompt_files],
        "max_new_tokens": max_new_tokens,
    }
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=True)
        if saved.get("key") != key or "token_ids" not in saved:
            raise SystemExit(
                f"{cache} holds sequences of another model, prompt files or --max-new-tokens ({saved.get('key')}), "
                "or of an older format; give another --sequences file or remove it"
            )
        logger.info("read %d generated sequences from %s", len(saved["token_ids"]), cache)
        token_ids = [(ids, num_prompt_tokens) for ids, num_prompt_tokens in saved["token_ids"]]
    else:
        token_ids = generate_token_ids(model_dir, prompt_files, max_new_tokens)
        if cache is not None:
            partial = cache.with_name(cache.name + ".partial")
            torch.save({"key": key, "token_ids": token_ids}, partial)
            partial.rename(cache)
    return with_hidden_states(model, token_ids, aux_layers)


def warmup_cosine(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over a tenth of the steps, then cosine decay to 0 (train_eagle3.py uses it too)."""
    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
    )


def train(
    model: nn.Module,
    mtp: TrainableMTPLayer,
    sequences: list[Sequence],
    steps: int,
    lr: float,
    seed: int,
    rows_per_step: int,
) -> None:
    """AdamW, linear warm-up then cosine decay; each step one sequence (its whole context in one causal pass).

    The loss reads at most `rows_per_step` of its rows, drawn at random: the tied LM head over SmolLM2's
    49,152-token vocabulary, forward, backward and the target's, is most of a step's cost at a few hundred
    rows, while the MTP layer is one decoder layer; fewer rows a step buys more steps over more sequences.

    The target of row j is the model's own next-token distribution after t_{j+1}, lm_head(h_{j+1}), whose argmax
    is t_{j+2}: cross-entropy against it says how close each other token was, not only which one won, and on the
    default data it gave a held-out accuracy of 9.2% where the argmax alone gave 6.1%. The pre-trained decoder
    layer learns at a tenth of the rate of the new parts; at the full rate it over-fits a few thousand tokens."""
    decoder_params = list(mtp.mtp_block.parameters())
    decoder_ids = {id(param) for param in decoder_params}
    new_params = [param for param in mtp.parameters() if id(param) not in decoder_ids]
    groups = [{"params": new_params}, {"params": decoder_params, "lr": lr / 10}]
    optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    schedule = warmup_cosine(optimizer, steps)
    order = random.Random(seed)
    mtp.train()
    with tqdm(range(steps), desc="train", unit="step") as progress:
        for step in progress:
            sequence = order.choice(sequences)
            rows = sequence.training_rows
            num_rows = rows.stop - rows.start
            picked = torch.tensor(sorted(order.sample(range(num_rows), min(num_rows, rows_per_step))))
            with torch.no_grad():
                targets = model.lm_head(sequence.hidden_states[rows.start + 1 : rows.stop + 1][picked]).softmax(-1)
            hidden_states = mtp_hidden_states(model, mtp, sequence, rows)[picked]
            loss = F.cross_entropy(model.lm_head(hidden_states), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            progress.set_postfix(loss=f"{loss.item():.3f}")
            if (step + 1) % max(1, steps // 10) == 0:
                logger.info("step %d/%d: loss %.3f", step + 1, steps, loss.item())


@torch.no_grad()
def draft_accuracy(model: nn.Module, mtp: TrainableMTPLayer, sequences: list[Sequence]) -> tuple[float, int]:
    """Top-1 accuracy of the MTP's t_{j+2} over every draft row of `sequences`, and the number of rows."""
    mtp.eval()
    correct = total = 0
    for sequence in sequences:
        predicted = model.lm_head(mtp_hidden_states(model, mtp, sequence, sequence.draft_rows)).argmax(-1)
        correct += int((predicted == sequence.draft_targets).sum())
        total += predicted.numel()
    return correct / max(total, 1), total


def save_model_folder(model_dir: Path, output: Path, mtp_tensors: dict[str, torch.Tensor], record: dict) -> None:
    """A complete model folder: the model's files, its weights hard-linked, mtp.safetensors, one index over all.

    Written beside `output` and renamed into place, so an interrupted run leaves no half folder."""
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for shard, names in checkpoint_shards(model_dir).items():
        _link_or_copy(shard, partial / shard.name)
        if names is None:
            with safe_open(str(shard), framework="pt") as file:
                names = list(file.keys())
        weight_map |= dict.fromkeys(names, shard.name)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (INDEX_FILE, "config.json"):
            shutil.copy2(path, partial / path.name)
    config = json.loads((model_dir / "config.json").read_text())
    (partial / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}, indent=2) + "\n")
    save_file(mtp_tensors, str(partial / MTP_WEIGHTS_FILE))
    weight_map |= dict.fromkeys(mtp_tensors, MTP_WEIGHTS_FILE)
    (partial / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")
    (partial / TRAINING_RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(output, ignore_errors=True)
    partial.rename(output)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(source, target)


def training_arguments(description: str, steps: int, output_suffix: str) -> argparse.ArgumentParser:
    """The flags a head trained on the model's own outputs takes (train_eagle3.py's too)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", type=Path, default=None, help="HF Llama folder; default: the default model")
    parser.add_argument(
        "--prompts", type=Path, nargs="+", default=list(DEFAULT_PROMPT_FILES), help="JSONL prompt files (dataset/)"
    )
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps, one sequence each")
    parser.add_argument(
        "--output", type=Path, default=None, help=f"default: <model folder>{output_suffix} beside the model"
    )
    parser.add_argument("--max-new-tokens", type=int, default=160, help="greedy tokens generated per prompt")
    parser.add_argument(
        "--sequences",
        type=Path,
        default=None,
        help="file caching the generated sequences: read when written for the same model, prompts and "
        "--max-new-tokens (by either training script), else written",
    )
    parser.add_argument("--held-out", type=float, default=0.2, help="share of sequences kept for the accuracy")
    parser.add_argument("--lr", type=float, default=1e-3, help="of the new parts (MTP: the decoder layer's is a tenth)")
    parser.add_argument("--seed", type=int, default=0)
    # One thread: on a busy machine a second one mostly waits for the first (7x slower measured on 2 shared cores).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = training_arguments(__doc__.splitlines()[0], steps=2000, output_suffix="-MTP")
    parser.add_argument("--rows-per-step", type=int, default=64, help="rows of a sequence the loss reads a step")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rows_per_step < 1 or args.max_new_tokens < 2 or not 0 < args.held_out < 1:
        parser.error("--steps and --rows-per-step must be >= 1, --max-new-tokens >= 2 and --held-out between 0 and 1")
    return args


def check_paths(model_dir: Path, output: Path, prompt_files: list[Path]) -> None:
    """Fail before minutes of work, and never replace a folder this script did not write."""
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"train_mtp_head: --model {model_dir} is not a model folder (no config.json)")
    if json.loads((model_dir / "config.json").read_text()).get("num_nextn_predict_layers"):
        raise SystemExit(f"train_mtp_head: --model {model_dir} already has MTP layers; give the model without them")
    for path in prompt_files:
        if not path.is_file():
            raise SystemExit(f"train_mtp_head: --prompts {path} is not a file")
    if output.exists() and not (output / TRAINING_RECORD_FILE).is_file():
        raise SystemExit(f"train_mtp_head: --output {output} exists and is not a folder this script wrote")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_logging()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = (args.model or default_model_path()).expanduser().resolve()
    output = (args.output or model_dir.with_name(model_dir.name + "-MTP")).expanduser().resolve()
    check_paths(model_dir, output, args.prompts)
    start_s = time.perf_counter()
    with logging_redirect_tqdm():
        logger.info("generating greedy continuations of %s with %s", ", ".join(p.name for p in args.prompts), model_dir)
        model = load_frozen_model(model_dir)
        try:
            sequences = cached_sequences(model, model_dir, args.prompts, args.max_new_tokens, args.sequences)
        except DatasetError as error:
            raise SystemExit(f"train_mtp_head: {error}") from None
        sequences = [s for s in sequences if s.draft_rows.stop > s.draft_rows.start]  # at least one draft row
        random.Random(args.seed).shuffle(sequences)
        num_held_out = max(1, round(len(sequences) * args.held_out))
        held_out, training = sequences[:num_held_out], sequences[num_held_out:]
        generate_s = time.perf_counter() - start_s
        logger.info(
            "%d training and %d held-out sequences (%d generated tokens) in %.0f s",
            len(training), len(held_out), sum(len(s.token_ids) - s.num_prompt_tokens for s in sequences), generate_s,
        )  # fmt: skip
        mtp = TrainableMTPLayer(model)
        accuracy_before, num_rows = draft_accuracy(model, mtp, held_out)
        train(model, mtp, training, args.steps, args.lr, args.seed, args.rows_per_step)
        accuracy, _ = draft_accuracy(model, mtp, held_out)
    record = {
        "held_out_draft1_top1_accuracy": round(accuracy, 4),
        "held_out_draft1_top1_accuracy_at_init": round(accuracy_before, 4),
        "held_out_rows": num_rows,
        "held_out_sequences": len(held_out),
        "training_sequences": len(training),
        "steps": args.steps,
        "rows_per_step": args.rows_per_step,
        "lr": args.lr,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        "prompts": [p.name for p in args.prompts],
        "generate_s": round(generate_s, 1),
        "total_s": round(time.perf_counter() - start_s, 1),
    }
    save_model_folder(model_dir, output, mtp.checkpoint_tensors(model.config.num_hidden_layers), record)
    logger.info(
        "held-out top-1 accuracy of draft 1: %.1f%% over %d rows (%.1f%% before training); %.0f s; saved %s",
        100 * accuracy, num_rows, 100 * accuracy_before, record["total_s"], output,
    )  # fmt: skip
    return record


if __name__ == "__main__":
    main()
