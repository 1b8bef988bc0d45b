"""Write dataset/long_context.jsonl: long prompts (2k to 8k tokens under the SmolLM2 tokenizer) for
long-prefill runs without a downloaded benchmark.

Each prompt is a made-up structured document (a service log, a stock table, a residents' register,
a ship's log, a configuration dump, a timetable) with one question at the end about a detail that
sits somewhere inside it. Everything is drawn from a seeded random.Random, and a document grows
row by row until it reaches its token target, so the file is the same on every run:

    python scripts/make_long_context.py            # rewrites dataset/long_context.jsonl
    python scripts/make_long_context.py --check    # exit 1 if the file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DATASET_DIR, PromptRecord, tokenize_record

OUTPUT = DATASET_DIR / "long_context.jsonl"
SEED = 20240523
# Token targets through the chat template (as a run with apply_chat_template on counts them),
# spread over 2k..8k with room on either side for the template's own tokens.
TARGETS = (2200, 2600, 3000, 3500, 4000, 4500, 5000, 5600, 6200, 6800, 7300, 7800)

_FIRST = ("Mara", "Tobin", "Ilse", "Quentin", "Odile", "Ravi", "Sunniva", "Bram", "Yusra", "Caspian", "Lorna", "Emeka")
_LAST = ("Linwood", "Ashgrove", "Petrak", "Valdez", "Okonkwo", "Hallberg", "Moreau", "Tanaka", "Fenwick", "Duarte")
_STREETS = ("Quill Street", "Marrow Lane", "Hollow Road", "Cinder Row", "Alder Court", "Brackwater Way", "Fell Close")
_PETS = ("a tortoise", "two finches", "a grey cat", "a lurcher", "a rabbit", "goldfish", "a ferret", "no pets")
_SERVICES = ("auth", "billing", "search", "ingest", "thumbnailer", "mailer", "scheduler", "gateway")
_MESSAGES = (
    "request served",
    "cache warmed",
    "health check passed",
    "connection pool resized",
    "batch flushed",
    "config reloaded",
    "lease renewed",
)
_ITEMS = ("hex bolt", "brass hinge", "oak dowel", "copper pipe", "rubber gasket", "steel bracket", "pine plank")
_WAREHOUSES = ("Northgate", "Riverside", "Eastmoor", "Kilnworth", "Saltmarsh")
_STATIONS = ("Ambrey", "Coldharbour", "Dunmore", "Elsford", "Gravenhurst", "Harlow Cross", "Inchmere", "Juniper Halt")
_WINDS = ("N", "NE", "E", "SE", "S", "SW", "W", "NW")
_CARGO = ("salt cod", "tin ingots", "wool bales", "lamp oil", "timber", "barley", "slate", "rope")


@dataclass(frozen=True, slots=True)
class Document:
    """A kind of document: its opening line, a row maker, and the question about one chosen row."""

    kind: str
    heading: str
    row: Callable[[random.Random, int], str]
    question: Callable[[int], str]  # the question about row n (from 1)


def _resident(rng: random.Random, n: int) -> str:
    return (
        f"Resident {n}: {rng.choice(_FIRST)} {rng.choice(_LAST)} lives at {rng.randint(1, 220)} "
        f"{rng.choice(_STREETS)}, keeps {rng.choice(_PETS)}, and has locker code {rng.randint(1000, 9999)}."
    )


def _log_line(rng: random.Random, n: int) -> str:
    seconds = n * 7 + rng.randint(0, 6)
    stamp = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    level = "WARN" if rng.random() < 0.08 else "INFO"
    return (
        f"[{stamp}] host-{rng.randint(1, 40):02d} service={rng.choice(_SERVICES)} level={level} "
        f"event={n} msg={rng.choice(_MESSAGES)} latency_ms={rng.randint(2, 900)}"
    )


def _stock_row(rng: random.Random, n: int) -> str:
    return (
        f"| SKU-{10000 + n} | {rng.choice(_ITEMS)} | {rng.choice(_WAREHOUSES)} | {rng.randint(0, 5000)} | "
        f"{rng.randint(1, 400)}.{rng.randint(0, 99):02d} |"
    )


def _ship_day(rng: random.Random, n: int) -> str:
    return (
        f"Day {n}: wind {rng.randint(2, 40)} knots from the {rng.choice(_WINDS)}, {rng.randint(20, 180)} nautical "
        f"miles run, {rng.randint(1, 90)} tons of {rng.choice(_CARGO)} in the forward hold."
    )


def _config_entry(rng: random.Random, n: int) -> str:
    value = rng.choice(("true", "false", str(rng.randint(0, 65535)), f"0x{rng.getrandbits(24):06x}"))
    return f"{rng.choice(_SERVICES)}.option_{n:04d} = {value}"


def _train(rng: random.Random, n: int) -> str:
    hour, minute = divmod(300 + n * 4 + rng.randint(0, 3), 60)
    origin, destination = rng.sample(_STATIONS, 2)
    return (
        f"Service {700 + n}: leaves {origin} at {hour % 24:02d}:{minute:02d} for {destination}, "
        f"platform {rng.randint(1, 12)}, {rng.randint(3, 12)} carriages."
    )


DOCUMENTS = (
    Document(
        "residents",
        "The residents' register of the Fellmarsh housing cooperative, one entry per resident:",
        _resident,
        lambda n: f"What is the locker code of Resident {n}, and on which street do they live?",
    ),
    Document(
        "log",
        "The service log of the cluster for one night, one event per line:",
        _log_line,
        lambda n: f"Which host logged event={n}, at what time, and what was its latency_ms?",
    ),
    Document(
        "stock",
        "Stock table of the hardware wholesaler, columns: SKU | item | warehouse | quantity | unit price:",
        _stock_row,
        lambda n: f"How many units of SKU-{10000 + n} are in stock, and in which warehouse?",
    ),
    Document(
        "ship",
        "The log of the cargo ship Kestrel, one entry per day at sea:",
        _ship_day,
        lambda n: f"On Day {n}, what cargo was in the forward hold and how strong was the wind?",
    ),
    Document(
        "config",
        "A dump of the platform's configuration, one key per line:",
        _config_entry,
        lambda n: f"What is the value of the key that ends in option_{n:04d}, and which service does it belong to?",
    ),
    Document(
        "timetable",
        "The winter timetable of the Juniper Valley railway, one service per line:",
        _train,
        lambda n: f"At what time does Service {700 + n} leave, from which station, and from which platform?",
    ),
)


def compose(document: Document, rows: list[str], asked: int) -> str:
    body = "\n".join(rows)
    question = document.question(asked + 1)
    return f"{document.heading}\n\n{body}\n\nAnswer from the document above. {question}"


def count_tokens(prompt: str, tokenizer: PreTrainedTokenizerBase) -> int:
    return len(tokenize_record(PromptRecord(id="count", prompt=prompt), tokenizer, apply_chat_template=True))


def make_prompt(document: Document, target: int, rng: random.Random, tokenizer: PreTrainedTokenizerBase) -> str:
    """The document with as many rows as fit in `target` tokens, asked about a row in its middle 80%."""
    rows = [document.row(rng, n) for n in range(1, 2 * target // 10)]  # rows are over 10 tokens each
    low, high = 2, len(rows)  # the most rows whose prompt is within target: binary search
    while low < high:
        mid = (low + high + 1) // 2
        if count_tokens(compose(document, rows[:mid], 0), tokenizer) <= target:
            low = mid
        else:
            high = mid - 1
    kept = rows[:low]
    asked = rng.randint(len(kept) // 10, len(kept) * 9 // 10)
    return compose(document, kept, asked)


def generate(tokenizer: PreTrainedTokenizerBase) -> str:
    """The file's text: one {"id", "prompt"} line per target, the document kinds in turn."""
    rng = random.Random(SEED)
    lines = []
    for index, target in enumerate(TARGETS):
        document = DOCUMENTS[index % len(DOCUMENTS)]
        prompt = make_prompt(document, target, rng, tokenizer)
        lines.append(json.dumps({"id": f"{document.kind}-{target}", "prompt": prompt}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args(argv)
    text = generate(AutoTokenizer.from_pretrained(default_model_path()))
    if args.check:
        same = OUTPUT.is_file() and OUTPUT.read_text(encoding="utf-8") == text
        print(f"{OUTPUT}: {'up to date' if same else 'differs from what the script writes'}")
        return 0 if same else 1
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT} ({len(TARGETS)} prompts, {len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
