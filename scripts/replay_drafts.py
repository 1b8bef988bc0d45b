"""Replay an EAGLE-3 drafter over a model's own greedy outputs: where its drafts would be accepted, per prompt.

    PYTHONPATH=. .venv/bin/python scripts/replay_drafts.py [--model DIR] [--drafter DIR] [--prompts FILE ...]
        [--max-new-tokens N] [--num-speculative-tokens K] [--sequences FILE]

The engine generates the model's greedy continuations of the prompts (train_eagle3.py's sequences:
fp32, chat template, each to its EOS or --max-new-tokens), and the drafter's chain is unrolled over
each at every position as its training-time test does: teacher-forced, its K/V over the model's own
tokens and hidden states, as the proposer's first pass after each verify writes it. Then each
sequence is stepped through as a run steps through it: from the token a step emits, the k drafts the
next step verifies (cut to what max_new_tokens leaves, as the scheduler cuts them), the matching
prefix accepted and the model's token after it. Printed as JSON, per prompt and over all: the
teacher-forced accept rate by draft position, the generated tokens outside the draft vocabulary
(which it can never draft), and the accept length a run would report (tokens a request emits per
verify) with the drafter alone and with prompt lookup in front of it (speculative_config.prompt_lookup).

A run spends more steps where the drafts fail (one token a step) than where they hold, so its
accept length lies below what the teacher-forced rates suggest; this replay gives the run's
(docs/benchmarks.md, "Prompt lookup in front of the EAGLE-3 drafter"), without timing anything.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoConfig

from executor.core.spec_decode.ngram import NgramProposer
from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DATASET_DIR, DatasetError
from executor.types_ import AcceptCounts
from executor.utils.logging_config import setup_logging
from models.llama.eagle3 import aux_hidden_state_layers
from scripts.train_eagle3 import TrainableEagle3, accept_rates
from scripts.train_mtp_head import Sequence, cached_sequences, load_frozen_model

logger = logging.getLogger("replay_drafts")

# the drafts a step verifies, from the tokens known so far (the last one emitted by the step before)
DraftSource = Callable[[list[int]], list[int]]


@torch.no_grad()
def draft_chains(model: nn.Module, drafter: TrainableEagle3, sequence: Sequence, depth: int) -> list[list[int]]:
    """[step][row j]: the target id of the chain's draft step + 1 after row j (it predicts t_{j+2+step})."""
    logits = drafter(model, sequence.token_ids, sequence.aux_hidden_states, depth)
    return [drafter.draft_token_ids[step_logits.argmax(-1)].tolist() for step_logits in logits]


def chain_source(chains: list[list[int]]) -> DraftSource:
    """The drafter's chain after the last known token: the one from row len(tokens) - 2."""
    return lambda tokens: [chain[len(tokens) - 2] for chain in chains]


def lookup_first(lookup: NgramProposer, fallback: DraftSource) -> DraftSource:
    """speculative_config.prompt_lookup: the lookup's drafts where the last n-gram recurs, else the fallback's."""
    return lambda tokens: lookup.propose_for(tokens) or fallback(tokens)


def replay(token_ids: list[int], num_prompt_tokens: int, max_new_tokens: int, drafts_for: DraftSource) -> AcceptCounts:
    """A greedy run over the known tokens (the prompt, then the model's own output, ending at its EOS
    or its budget), stepped as the engine steps: each decode step verifies the drafts proposed after
    the token before it, cut so that its accepted drafts and one more token stay within
    max_new_tokens; the counts a run's summary.json would hold."""
    counts = AcceptCounts()
    end = len(token_ids)
    budget_end = num_prompt_tokens + max_new_tokens
    position = num_prompt_tokens + 1  # the prefill step emitted the first output token
    while position < end:
        drafts = drafts_for(token_ids[:position])[: max(budget_end - position - 1, 0)]
        accepted = 0
        while (
            accepted < len(drafts) and position + accepted < end and drafts[accepted] == token_ids[position + accepted]
        ):
            accepted += 1
        if drafts:
            counts.add_verify(len(drafts), accepted)
        position += accepted + 1
    return counts


@dataclass(slots=True)
class PromptReplay:
    """One prompt's figures."""

    generated_tokens: int
    outside_draft_vocabulary: int
    teacher_forced_accept_rate_by_position: list[float]
    drafter: AcceptCounts
    lookup_then_drafter: AcceptCounts

    def summary(self) -> dict:
        return {
            "generated_tokens": self.generated_tokens,
            "outside_draft_vocabulary": self.outside_draft_vocabulary,
            "teacher_forced_accept_rate_by_position": [
                round(rate, 4) for rate in self.teacher_forced_accept_rate_by_position
            ],
            "accept_length_drafter": round(accept_length(self.drafter), 4),
            "accept_length_lookup_then_drafter": round(accept_length(self.lookup_then_drafter), 4),
        }


def accept_length(counts: AcceptCounts) -> float:
    """What summary.json's mean_accept_length reports: tokens per verify, accepted drafts plus one."""
    return 1 + counts.num_accepted / max(counts.verifies, 1)


def replay_sequence(
    model: nn.Module, drafter: TrainableEagle3, sequence: Sequence, args: argparse.Namespace
) -> PromptReplay:
    chains = draft_chains(model, drafter, sequence, args.num_speculative_tokens)
    tokens = sequence.token_ids.tolist()
    generated = tokens[sequence.num_prompt_tokens :]
    vocabulary = set(drafter.draft_token_ids.tolist())
    lookup = NgramProposer(args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max)
    rates, _ = accept_rates(model, drafter, [(sequence, sequence.aux_hidden_states)], args.num_speculative_tokens)

    def run(source: DraftSource) -> AcceptCounts:
        return replay(tokens, sequence.num_prompt_tokens, args.max_new_tokens, source)

    return PromptReplay(
        generated_tokens=len(generated),
        outside_draft_vocabulary=sum(token not in vocabulary for token in generated),
        teacher_forced_accept_rate_by_position=rates,
        drafter=run(chain_source(chains)),
        lookup_then_drafter=run(lookup_first(lookup, chain_source(chains))),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="HF Llama folder; default: the default model")
    parser.add_argument(
        "--drafter",
        type=Path,
        default=None,
        help="an EAGLE-3 folder scripts/train_eagle3.py wrote for the model; default: <model>-EAGLE3 beside it",
    )
    parser.add_argument("--prompts", type=Path, nargs="+", default=[DATASET_DIR / "default.jsonl"])
    parser.add_argument("--max-new-tokens", type=int, default=48, help="the run's max_new_tokens")
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument(
        "--sequences", type=Path, default=None, help="cache of the generated sequences (as train_eagle3.py)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    if min(args.max_new_tokens, args.num_speculative_tokens, args.prompt_lookup_min) < 1:
        parser.error("--max-new-tokens, --num-speculative-tokens and --prompt-lookup-min must be >= 1")
    if args.prompt_lookup_min > args.prompt_lookup_max:
        parser.error("--prompt-lookup-min exceeds --prompt-lookup-max")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    setup_logging()
    torch.set_num_threads(args.threads)
    model_dir = (args.model or default_model_path()).expanduser().resolve()
    drafter_dir = (args.drafter or model_dir.with_name(model_dir.name + "-EAGLE3")).expanduser().resolve()
    if not (drafter_dir / "model.safetensors").is_file():
        raise SystemExit(
            f"replay_drafts: --drafter {drafter_dir} holds no model.safetensors (scripts/train_eagle3.py writes one)"
        )
    with logging_redirect_tqdm():
        model = load_frozen_model(model_dir)
        draft_config = AutoConfig.from_pretrained(drafter_dir)
        layers = aux_hidden_state_layers(draft_config, model.config.num_hidden_layers)
        try:
            sequences = cached_sequences(model, model_dir, args.prompts, args.max_new_tokens, args.sequences, layers)
        except DatasetError as error:
            raise SystemExit(f"replay_drafts: {error}") from None
        try:
            drafter = TrainableEagle3.from_folder(model, drafter_dir).eval()
        except (RuntimeError, KeyError) as error:  # a drafter of other shapes than the script trains
            first_line = str(error).strip().splitlines()[0]
            raise SystemExit(
                f"replay_drafts: --drafter {drafter_dir} is not a drafter scripts/train_eagle3.py wrote for this "
                f"model ({first_line})"
            ) from None
        replays = [replay_sequence(model, drafter, sequence, args) for sequence in sequences]
    totals = {"drafter": AcceptCounts(), "lookup_then_drafter": AcceptCounts()}
    for item in replays:
        totals["drafter"].add(item.drafter)
        totals["lookup_then_drafter"].add(item.lookup_then_drafter)
    report = {
        "model": str(model_dir),
        "drafter": str(drafter_dir),
        "max_new_tokens": args.max_new_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "accept_length": {name: round(accept_length(counts), 4) for name, counts in totals.items()},
        "accept_rate_by_position": {
            name: [round(entry["accept_rate"], 4) for entry in counts.per_position()] for name, counts in totals.items()
        },
        "outside_draft_vocabulary": sum(item.outside_draft_vocabulary for item in replays)
        / max(sum(item.generated_tokens for item in replays), 1),
        "prompts": [item.summary() for item in replays],
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
