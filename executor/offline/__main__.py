"""`python -m executor.offline --yaml FILE [--set section.key=value ...]`: the entry every infer.sh calls."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from executor.core.config import ConfigError, InferenceConfig, load_config
from executor.core.config.inference_config import unused_npu_keys
from executor.model_loader.default_model import default_model_path
from executor.offline.dataset import DATASET_DIR, DatasetError, PromptRecord, load_prompts, resolve_dataset_path
from executor.offline.offline_inference import OfflineInference, RunResult
from executor.offline.results import ResultWriter, default_output_dir
from executor.utils.logging_config import setup_logging
from executor.utils.model_registry import check_model_name

logger = logging.getLogger("executor.offline")


def resolve_model_path(config: InferenceConfig) -> Path:
    """model_config.model_path (with ~ and $VARS expanded), or the default model; must hold config.json."""
    configured = config.model_config.model_path
    path = Path(os.path.expandvars(configured)).expanduser() if configured else default_model_path()
    if not (path / "config.json").is_file():
        hint = "" if configured else "; run `bash infer.sh` (or scripts/setup.sh) once to fetch the default model"
        raise ConfigError(
            f"model_config.model_path {str(path)!r} in {config.source} is not a model folder (no config.json){hint}"
        )
    return path


def load_records(config: InferenceConfig) -> list[PromptRecord]:
    data = config.data_config
    records = load_prompts(resolve_dataset_path(data.dataset, data.dataset_path or None, DATASET_DIR))
    return records[: data.num_prompts] if data.num_prompts else records


def print_report(result: RunResult, output_dir: Path) -> None:
    for entry in result.results:
        print(f"\n=== [{entry['id']}] prompt: {entry['prompt']}")
        if entry["error"]:
            print(f"--- FAILED: {entry['error']}")
        else:
            print(f"--- output ({entry['finish_reason']}): {entry['output_text']}")
    print("\n=== summary")
    print(json.dumps(result.summary, indent=2))
    print(f"results written to {output_dir}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.offline", description=__doc__)
    parser.add_argument("--yaml", required=True, help="the run's YAML config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    setup_logging()
    try:  # everything that can be wrong with the input is found before the model loads
        config = load_config(args.yaml, args.overrides)
        check_model_name(config.model_config.model_name, config.source)
        records = load_records(config)
        model_path = resolve_model_path(config)
    except (ConfigError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:  # rules that need the platform or the model's config.json, still checked before the weights load
        inference = OfflineInference(config, str(model_path))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key in unused_npu_keys(config, inference.engine.platform.device_type):
        logger.info("%s only applies on NPU; unused here", key)
    output_dir = default_output_dir(config)
    writer = ResultWriter(output_dir)
    writer.write_config(config)
    try:
        result = inference.generate(records, writer)
    except ConfigError as exc:  # a KV pool too small for every request of the run
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        writer.close()
    print_report(result, output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
