"""Make a draft model for speculative decoding from a Llama-family model folder: its first N layers.

The draft keeps the model's embedding, final norm, LM head and tokenizer and drops every layer
from N on (a self-speculative "layer skip" draft), so it needs no download and shares the
tokenizer by construction. It is written as a complete model folder for
`speculative_config.draft_model_path`:

    python scripts/make_layer_skip_draft.py --layers 8
    # -> $INFER_RECIPES_HOME/models/SmolLM2-135M-Instruct-draft8
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from executor.model_loader.default_model import default_model_path

LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def make_draft(source: Path, output: Path, num_layers: int) -> Path:
    config = json.loads((source / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in 1..{config['num_hidden_layers'] - 1}, got {num_layers}")
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            match = LAYER_NAME.match(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = tensor
    output.mkdir(parents=True, exist_ok=True)
    save_file(tensors, output / "model.safetensors", metadata={"format": "pt"})
    (output / "config.json").write_text(json.dumps(config | {"num_hidden_layers": num_layers}, indent=2))
    for name in COPIED_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, output / name)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--layers", type=int, default=8, help="layers the draft keeps")
    parser.add_argument("--output", type=Path, default=None, help="default: <source>-draft<layers> beside it")
    args = parser.parse_args()
    source = args.source or default_model_path()
    output = args.output or source.with_name(f"{source.name}-draft{args.layers}")
    print(make_draft(source, output, args.layers))


if __name__ == "__main__":
    main()
