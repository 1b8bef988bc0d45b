"""`python -m executor.offline --yaml FILE [--set section.key=value ...]`: the entry every infer.sh calls.

With parallel_config.world_size above 1 it runs as one of torchrun's processes (infer.sh starts them
through executor/offline/launch.py); rank 0 writes the run folder, and with several data-parallel
replicas each replica's leader writes its own outputs_dp<d>.jsonl and step log beside."""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from executor.core.config import ConfigError, InferenceConfig, load_config
from executor.core.config.comm_manager import DistEnv
from executor.core.config.inference_config import not_applicable_keys
from executor.core.config.model_registry import check_model_name, resolve_model
from executor.model_loader.default_model import default_model_path, expand_home_vars
from executor.offline.dataset import (
    DATASET_DIR,
    DatasetError,
    PromptRecord,
    check_token_ids,
    load_prompts,
    repeat_to_count,
    resolve_dataset_path,
)
from executor.offline.durable_io import OutputWriteError
from executor.offline.exit_status import COULD_NOT_START, STOPPED_ON_ERROR, finished_run_status
from executor.offline.interrupts import RunInterrupted, StopSignals, exit_status_for
from executor.offline.long_benchmarks import benchmark_request, load_benchmark_records
from executor.offline.offline_inference import OfflineInference, RunResult
from executor.offline.preflight import (
    check_device,
    check_kv_pool,
    check_model_folder,
    check_parallel_layout,
    check_quantization,
    check_speculation,
    one_line,
)
from executor.offline.rank_faults import is_lost_peer, stopped_line
from executor.offline.results import ResultWriter, default_output_dir, failed_record_result
from executor.offline.run_folder import OUTPUTS_FILE, SUMMARY_FILE, RunPlan, plan_run
from executor.offline.summary_table import summary_lines
from executor.utils.logging_config import setup_logging

logger = logging.getLogger("executor.offline")


def resolve_model_path(config: InferenceConfig) -> Path:
    """model_config.model_path (with ~ and $VARS expanded, $INFER_RECIPES_HOME to its default when unset), or the
    default model; must hold config.json."""
    configured = config.model_config.model_path
    path = Path(expand_home_vars(configured)).expanduser() if configured else default_model_path()
    if not (path / "config.json").is_file():
        hint = "" if configured else "; run `bash infer.sh` (or scripts/setup.sh) once to fetch the default model"
        if path == default_model_path(blocks=True):
            hint = "; run `python -m executor.model_loader.default_model --blocks` once to write it"
        raise ConfigError(
            f"model_config.model_path {str(path)!r} in {config.source} is not a model folder (no config.json){hint}"
        )
    return path


def load_records(config: InferenceConfig) -> list[PromptRecord]:
    """The dataset's records: the first num_prompts of them, then, with cann-recipes' meaning of
    batch_size, repeated or cut to exactly batch_size requests."""
    data = config.data_config
    request = benchmark_request(data, config.scheduler_config.max_new_tokens, DATASET_DIR)
    if request is not None:  # LongBench, InfiniteBench: the model's tokenizer cuts their prompts
        records = load_benchmark_records(request, lambda: AutoTokenizer.from_pretrained(resolve_model_path(config)))
    else:
        records = load_prompts(resolve_dataset_path(data.dataset, data.dataset_path or None, DATASET_DIR))
    records = records[: data.num_prompts] if data.num_prompts else records
    if config.scheduler_config.batch_size_meaning == "num_requests":
        records = repeat_to_count(records, config.scheduler_config.batch_size)
    return records


def print_results(result: RunResult) -> None:
    for entry in result.results:
        print(f"\n=== [{entry['id']}] prompt: {entry['prompt']}")
        if entry["error"]:
            print(f"--- FAILED: {entry['error']}")
        else:
            print(f"--- output ({entry['finish_reason']}): {entry['output_text']}")


def print_summary(summary: dict[str, Any], output_dir: Path) -> None:
    """The end table, and where the run's files are (summary.json has every figure)."""
    print()
    print("\n".join(summary_lines(summary, output_dir / SUMMARY_FILE)))
    print(f"results written to {output_dir}")


@dataclass(slots=True)
class CheckedModel:
    """A config whose model, device and pool were checked, before any weight is read."""

    config: InferenceConfig
    model_path: Path
    device_type: str
    vocab_size: int


@dataclass(slots=True)
class PreparedRun:
    config: InferenceConfig
    model_path: Path
    device_type: str
    plan: RunPlan


def check_model_config(yaml_path: str, overrides: list[str]) -> CheckedModel:
    """The config loaded, and everything about its model that can be wrong found before it loads
    (ConfigError): the model's name and folder, quantization, speculation, the parallel layout,
    the device and the KV pool. Both entries start with it."""
    config = load_config(yaml_path, overrides)
    check_model_name(config.model_config.model_name, config.source)
    model_path = resolve_model_path(config)
    model_cls, config_cls = resolve_model(config.model_config.model_name)
    hf_config = check_model_folder(model_path, config_cls, config.model_config.with_ckpt)
    check_quantization(config, hf_config, model_path)
    check_speculation(config, model_cls, hf_config, model_path)
    check_parallel_layout(config, hf_config)
    device_type = check_device(config)
    check_kv_pool(config, getattr(hf_config, "max_position_embeddings", 0))
    return CheckedModel(config, model_path, device_type, hf_config.vocab_size)


def prepare_run(yaml_path: str, overrides: list[str]) -> PreparedRun:
    """Everything that can be wrong with the input, found before the model loads (ConfigError, DatasetError)."""
    checked = check_model_config(yaml_path, overrides)
    config = checked.config
    records = check_token_ids(load_records(config), checked.vocab_size)
    plan = plan_run(default_output_dir(config), config, records)
    return PreparedRun(config, checked.model_path, checked.device_type, plan)


def resume_command(args: argparse.Namespace, config: InferenceConfig, output_dir: Path) -> str:
    """The command line that continues this run (through the launcher when it needs torchrun)."""
    entry = "executor.offline.launch" if config.parallel_config.world_size > 1 else "executor.offline"
    words = ["python", "-m", entry, "--yaml", args.yaml]
    for override in args.overrides:
        words += ["--set", override]
    if not config.model_config.output_path:
        words += ["--set", f"model_config.output_path={output_dir}"]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.offline", description=__doc__)
    parser.add_argument("--yaml", required=True, help="the run's YAML config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    setup_logging()
    with StopSignals() as stop:
        try:
            return run(args, stop)
        except RunInterrupted as exc:  # before the run folder was written to
            print(
                f"interrupted ({signal.Signals(exc.signum).name}) before any request ran; nothing written",
                file=sys.stderr,
            )
            return exit_status_for(exc.signum)
        except Exception as exc:
            report_rank_failure(exc)
            raise


_RANK_FAILURE_REPORTED = "_rank_failure_reported"


def report_rank_failure(exc: BaseException) -> None:
    """Under torchrun, say once which rank failed and why (torchrun then stops the other ranks). The
    run says it before it closes its process groups: peers waiting in a collective fail as soon as
    the connections close, and torchrun may stop this rank before it gets further."""
    env = DistEnv.from_environ()
    if env.world_size <= 1 or not isinstance(exc, Exception) or getattr(exc, _RANK_FAILURE_REPORTED, False):
        return
    print(f"error: rank {env.rank} of {env.world_size} failed: {one_line(exc)}", file=sys.stderr, flush=True)
    with contextlib.suppress(AttributeError):
        setattr(exc, _RANK_FAILURE_REPORTED, True)


def run(args: argparse.Namespace, stop: StopSignals) -> int:
    try:
        prepared = prepare_run(args.yaml, args.overrides)
    except (ConfigError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return COULD_NOT_START
    config, plan = prepared.config, prepared.plan
    for key, why in not_applicable_keys(config, prepared.device_type):
        logger.info("%s is not applicable here, set but unused: %s", key, why)
    if config.disagg_config.disaggregation_mode != "NONE":  # cann-recipes' *_pd/prefill.yaml, decode.yaml
        logger.info(
            "disagg_config.disaggregation_mode %s: prefill-decode disaggregation is online only "
            "(python -m executor.online --pd-role); this offline run prefills and decodes in one engine",
            config.disagg_config.disaggregation_mode,
        )
    if plan.resumed:
        logger.info("continuing the run in %s: %d request(s) left", plan.output_dir, len(plan.pending))
    servable = [record for record in plan.pending if record.error is None]
    inference = None
    if servable:
        try:
            inference = OfflineInference(config, str(prepared.model_path))
        except (OSError, RuntimeError, ValueError) as exc:  # ConfigError and WeightLoadError are ValueErrors
            print(f"error: the model could not be loaded: {one_line(exc)}", file=sys.stderr)
            return COULD_NOT_START
    resume_hint = f"to resume, run: {resume_command(args, config, plan.output_dir)}"
    writer = None
    is_rank0 = DistEnv.from_environ().rank == 0
    try:
        if is_rank0:
            writer = ResultWriter(plan, config)
            for record in plan.pending:
                if record.error is not None:
                    writer.write_request(failed_record_result(record))
        if inference is not None:
            with stop.deferred():
                result = inference.serve(servable, writer, should_stop=stop.stop_requested.is_set, plan=plan)
            if result is not None:
                print_results(result)
        if stop.stop_requested.is_set():
            raise RunInterrupted(stop.signum or signal.SIGINT)
        if writer is None:  # a rank other than 0: rank 0 reports the run
            return 0
        summary = writer.finish("complete")
    except RunInterrupted as exc:
        stop.settle()  # torchrun forwards the terminal's SIGINT the rank got already: no second stop
        _finish_quietly(writer, "interrupted")
        name = signal.Signals(exc.signum).name
        print(
            f"interrupted ({name}); finished requests are in {plan.output_dir / OUTPUTS_FILE}; {resume_hint}",
            file=sys.stderr,
        )
        return exit_status_for(exc.signum)
    except OutputWriteError as exc:
        _finish_quietly(writer, "stopped on error")
        print(f"error: {exc}; finished requests are kept; {resume_hint}", file=sys.stderr)
        return STOPPED_ON_ERROR
    except BaseException as exc:
        env = DistEnv.from_environ()
        if env.world_size > 1 and is_lost_peer(exc):  # another rank is gone; nothing is wrong here
            stop.settle()  # torchrun's SIGTERM to the survivors only sets the flag from now on
            _finish_quietly(writer, "stopped on error")
            print(stopped_line(env.rank, env.world_size, str(plan.output_dir), resume_hint), file=sys.stderr)
            return STOPPED_ON_ERROR
        report_rank_failure(exc)
        _finish_quietly(writer, "stopped on error")
        raise
    finally:
        if writer is not None:
            writer.close()
        if inference is not None:
            inference.engine.comm.close()
    print_summary(summary, plan.output_dir)
    return finished_run_status(summary)


def _finish_quietly(writer: ResultWriter | None, status: str) -> None:
    """Mark summary.json on the way out of a failed run; a second error there must not hide the first."""
    if writer is not None:
        try:
            writer.finish(status)
        except OSError as exc:
            logger.warning("summary.json not updated: %s", exc)


if __name__ == "__main__":
    sys.exit(main())
