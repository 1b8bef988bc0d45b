"""OfflineInference: a fixed prompt list through the engine, with results and timings written as they come.

Each step record goes to the run folder's steps.jsonl (one JSON line each, steps_dp<d>.jsonl for
replica d) and steps.log (ours and cann-recipes' worded `[Main] Inference time (...)` line, so its log
parsers see every step) as it comes, and to the console only on a cadence (about CONSOLE_STEP_LINES a
run unless scheduler_config.console_step_interval says), so that the generated texts are not lost
between them (StepLog). Both step files are appended with whole lines and not synced: a crash may lose
the last few steps (they only time the run) or cut the last line short, which the next part of the
run drops (ResultWriter).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from executor.core.config import InferenceConfig
from executor.core.config.model_registry import model_folder
from executor.core.engine import EngineStep, ExecutionEngine, StepRecord
from executor.core.sampler import default_sampling_params, request_seed
from executor.core.sampler.constraints import ConstraintStats, prepare_constraints
from executor.offline.dataset import DatasetError, PromptRecord, tokenize_record
from executor.offline.durable_io import write_error
from executor.offline.metrics import breakdown_lines, cann_closing_lines, step_breakdown, summarize
from executor.offline.results import ReplicaWriter, ResultWriter, request_result
from executor.offline.run_folder import RunPlan, StepFiles
from executor.platform.profiler import StepProfiler
from executor.types_ import Request

logger = logging.getLogger(__name__)
step_logger = logging.getLogger("executor.steps")

SPEED_REFRESH_S = 0.5  # seconds between the progress bar's output tok/s figures


CONSOLE_STEP_LINES = 40


def console_step_interval(configured: int, num_requests: int, batch_size: int, max_new_tokens: int) -> int:
    """`configured`, or where it is 0 the interval that shows about CONSOLE_STEP_LINES step lines
    over a run's estimated steps (a prefill and max_new_tokens decode steps per batch of requests)."""
    if configured:
        return configured
    estimated_steps = math.ceil(num_requests / max(batch_size, 1)) * (1 + max_new_tokens)
    return max(1, math.ceil(estimated_steps / CONSOLE_STEP_LINES))


class StepLog:
    """Writes each step to the step files (while entered; it may be entered again, for the closing
    lines; a resumed run's parts follow each other) and logs the steps on the console's cadence.
    The files are written here, not through logging, so that the console's handler sees only the
    lines it shows."""

    def __init__(self, files: StepFiles | None, console_interval: int) -> None:
        self.console_interval = console_interval
        self.files = files
        self._text: TextIO | None = None
        self._jsonl: TextIO | None = None

    def __enter__(self) -> StepLog:
        if self.files is not None:
            self._text = self._open(self.files.text)
            self._jsonl = self._open(self.files.jsonl)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        files, self._text, self._jsonl = (self._text, self._jsonl), None, None
        for file in files:
            if file is None:
                continue
            try:
                file.close()  # flushes what a failed write left in the buffer, and may fail the same way
            except OSError as exc:
                if error is None:
                    raise write_error(Path(file.name), exc) from None

    def record(self, record: StepRecord) -> None:
        line = record.log_line()
        if (record.step - 1) % self.console_interval == 0:
            step_logger.info(line)
        if self.files is not None:
            self._write_text([line, record.cann_log_line()])
            json_line = json.dumps({"part": self.files.part, **dataclasses.asdict(record)})
            self._write(self._jsonl, self.files.jsonl, json_line)

    def cann_lines(self, lines: list[str]) -> None:
        """cann-recipes' own closing lines: steps.log only (the console's end table says the same)."""
        if self.files is not None:
            self._write_text(lines)

    def _write_text(self, lines: list[str]) -> None:
        assert self.files is not None
        stamp = time.strftime("%H:%M:%S")
        self._write(self._text, self.files.text, "\n".join(f"{stamp} {line}" for line in lines))

    @staticmethod
    def _open(path: Path) -> TextIO:
        try:
            return open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in __exit__)
        except OSError as exc:
            raise write_error(path, exc) from None

    @staticmethod
    def _write(file: TextIO | None, path: Path, text: str) -> None:
        """`text` and a newline as whole lines (one write of the flushed buffer), or a one-line error
        naming the file."""
        assert file is not None, "the step log is written while entered"
        try:
            file.write(text + "\n")
            file.flush()
        except OSError as exc:
            raise write_error(path, exc) from None


@dataclass(slots=True)
class RunResult:
    requests: list[Request]  # in dataset order
    results: list[dict[str, Any]]  # outputs.jsonl lines of the finished requests, in dataset order
    steps: list[StepRecord]
    summary: dict[str, Any]


class OfflineInference:
    def __init__(self, config: InferenceConfig, model_path: str) -> None:
        self.config = config
        self.engine = ExecutionEngine(config, model_path)
        self.core = self.engine.core
        self.default_sampling_params = default_sampling_params(config)
        self._replica_of_one_rank = self.engine.comm.layout.replica_size == 1

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        records: list[PromptRecord],
        writer: ResultWriter | ReplicaWriter | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> RunResult:
        """Run every record to completion, or until should_stop() says so between steps (then the
        unfinished requests are abandoned); a record that fails is reported alone. should_stop is
        polled before every step, so it should be cheap (StopSignals passes an Event's is_set)."""
        steps: list[StepRecord] = []
        results: dict[str, dict[str, Any]] = {}
        requests = [self._make_request(record) for record in records]
        log_structured_requests(requests)

        def finish(request: Request) -> None:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
            result = request_result(request, text)
            results[request.request_id] = result
            if writer is not None:
                writer.write_request(result)
            progress.update(1)

        def show_speed() -> None:
            """Output tokens per second so far on the bar (counted at most twice a second)."""
            nonlocal speed_shown_s
            now_s = time.perf_counter()
            if now_s - speed_shown_s >= SPEED_REFRESH_S:
                speed_shown_s = now_s
                output_tokens = sum(len(request.output_token_ids) for request in requests)
                progress.set_postfix_str(f"{output_tokens / (now_s - start_s):.1f} out tok/s", refresh=False)

        profiler = self._make_profiler(writer)
        comm = self.engine.comm
        comm.stats.take()  # warm-up's collectives are not the first step's
        counts_collectives = comm.is_distributed  # one process has none to count
        idle_steps = 0
        start_s = time.perf_counter()
        speed_shown_s = start_s
        sched = self.config.scheduler_config
        interval = console_step_interval(
            sched.console_step_interval, len(requests), sched.batch_size, sched.max_new_tokens
        )
        step_log = StepLog(None if writer is None else writer.step_files, interval)
        progress_bar = tqdm(total=len(requests), unit="req", desc="requests", disable=comm.rank != 0)
        with step_log, logging_redirect_tqdm(), progress_bar as progress:
            for request in requests:
                if request.is_finished:
                    finish(request)
                else:
                    self.core.add_request(request)
            while self._step_agreed(should_stop):
                output = self.core.step(profiler) if self.core.has_work() else EngineStep(None, [])
                if output.record is None and self.engine.lock_step:  # no forward ran here: the others need one
                    self.engine.runner.idle_forward()
                    comm.stats.take()  # an idle step is no step of this replica's log
                    idle_steps += 1
                if output.record is not None:
                    if counts_collectives:
                        output.record.comm_bytes = comm.stats.take()
                    steps.append(output.record)
                    step_log.record(output.record)
                for request in output.finished:
                    finish(request)
                show_speed()
        summary = summarize(requests, steps, start_s, time.perf_counter())
        if self.engine.lock_step:
            summary["lock_step_idle_steps"] = idle_steps
        decode_times_ms = [step.step_time_ms for step in steps if step.phase == "decode" and not step.profiled]
        model_name = self.config.model_config.model_name or model_folder("")
        with step_log:  # the closing lines go to the step text file too
            step_log.cann_lines(cann_closing_lines(model_name, decode_times_ms, summary, self.config.speculation[1]))
        for line in breakdown_lines(step_breakdown([dataclasses.asdict(step) for step in steps])):
            logger.info(line)
        if profiler is not None:
            profiler.close()
        summary |= self.core.scheduler.cache_stats() | {
            "device": str(self.engine.platform.device),
            "dtype": self.config.model_config.dtype,
            "exe_mode": self.config.model_config.exe_mode,
            "linear_layers": self.engine.worker.layer_schemes,
            "weight_bytes": self.engine.worker.weight_bytes,
            "kv_bytes_per_token": self.engine.worker.kv_cache_bytes_per_token(),
        }
        if (graph := self.engine.graph_stats()) is not None:
            summary["graph"] = graph
        method, num_speculative_tokens = self.config.speculation
        if method and "speculative" in summary:  # the proposer by name beside its accept rates (and per position)
            summary["speculative"].update(method=method, num_speculative_tokens=num_speculative_tokens)
            if draft_quantization := self.config.speculative_config.quantization:
                summary["speculative"]["quantization"] = draft_quantization
            if self.config.speculative_config.prompt_lookup:
                summary["speculative"]["prompt_lookup"] = True
        constraints = self.engine.runner.constraints
        stats = constraints.stats if constraints is not None else None
        if (structured := structured_output_summary(requests, stats)) is not None:
            summary["structured_output"] = structured
        if writer is not None:
            writer.write_summary(summary)
        return RunResult(requests, [results[r.request_id] for r in requests if r.request_id in results], steps, summary)

    def _step_agreed(self, should_stop: Callable[[], bool]) -> bool:
        """Whether to run another step. The ranks of one attention TP group run the same steps, so
        they stop after the same one. In lock-step (model groups span the DP replicas) every rank
        of the world steps while any has work, replicas without work running an idle forward. A
        replica of one rank has no one to agree with, so it asks no collective."""
        comm = self.engine.comm
        if self.engine.lock_step:
            anyone_has_work, anyone_stops = comm.agree_over_world(self.core.has_work(), should_stop())
            return anyone_has_work and not anyone_stops
        if self._replica_of_one_rank:
            return self.core.has_work() and not should_stop()
        return self.core.has_work() and not comm.any_in_replica(should_stop())

    def _make_profiler(self, writer: ResultWriter | ReplicaWriter | None) -> StepProfiler | None:
        """With model_config.enable_profiler, the steps it chooses are profiled into <output>/prof."""
        model_config = self.config.model_config
        if not model_config.enable_profiler or writer is None or writer.profile_dir is None:
            return None
        return StepProfiler(
            self.engine.platform.device_type,
            writer.profile_dir,
            model_config.profile_prefill_steps,
            model_config.profile_decode_steps,
        )

    def serve(
        self,
        records: list[PromptRecord],
        writer: ResultWriter | None,
        should_stop: Callable[[], bool],
        plan: RunPlan | None = None,
    ) -> RunResult | None:
        """generate() on this rank's share of `records`. One DP replica: every rank serves them all
        and rank 0 writes as requests finish. Several: replica d serves records d, d + dp, ...; with
        a `plan`, its leader writes each finished request to outputs_dp<d>.jsonl and each step to
        its step log as they come, so that a crash loses no finished request. The leaders' results
        are gathered on rank 0 at the end (or after a stop), which merges the per-replica files into
        outputs.jsonl in prompt order and writes one summary. The RunResult of the whole run on
        rank 0, None on the other ranks."""
        comm = self.engine.comm
        num_replicas = comm.layout.attn_dp_size
        assert writer is None or plan is not None or num_replicas == 1, "several replicas write by the plan"
        if num_replicas == 1:
            result = self.generate(records, writer if comm.rank == 0 else None, should_stop)
            return result if comm.rank == 0 else None
        replica_writer = None
        if comm.is_dp_leader and plan is not None:
            replica_writer = ReplicaWriter(plan, comm.dp_rank)
        try:
            result = self.generate(records[comm.dp_rank :: num_replicas], replica_writer, should_stop)
        finally:
            if replica_writer is not None:
                replica_writer.close()
        if not comm.is_dp_leader:
            return None
        gathered = comm.gather_from_dp_leaders(result)  # every replica has stopped writing
        if gathered is None:
            return None
        merged = merge_replicas(gathered, [record.id for record in records])
        if writer is not None:
            writer.add_replica_results(merged.results)
            writer.write_summary(merged.summary)
            writer.merge_replica_outputs()
        return merged

    def _make_request(self, record: PromptRecord) -> Request:
        """A request with the run's sampling parameters and the line's overrides; a record that
        cannot be tokenized or served fails alone. Without a seed of its own a request gets one
        derived from data_config.seed and its id, so that its samples do not depend on the batch."""
        prompt = record.prompt if record.prompt is not None else record.messages
        own_seed = {"seed": request_seed(self.config.data_config.seed, record.id)}
        params = dataclasses.replace(self.default_sampling_params, **(own_seed | record.sampling_overrides))
        try:
            token_ids = tokenize_record(record, self.tokenizer, self.config.data_config.apply_chat_template)
        except DatasetError as exc:
            return Request.failed(record.id, prompt, params, str(exc), time.perf_counter())
        if self.config.data_config.input_truncated_len:
            token_ids = token_ids[: self.config.data_config.input_truncated_len]
        reason = params.check()
        if reason is None and token_ids and max(token_ids) >= self.engine.vocab_size:
            reason = (
                f"the tokenizer gave token id {max(token_ids)}, outside the model's vocabulary of "
                f"{self.engine.vocab_size}: tokenizer and model do not match"
            )
        if reason is None:
            try:
                prepared = prepare_constraints(params, self.engine.structured_output)
            except ValueError as exc:  # a grammar that does not compile, a bad word the vocabulary lacks
                reason = str(exc)
        if reason is not None:
            return Request.failed(record.id, prompt, params, f"record {record.id!r}: {reason}", time.perf_counter())
        request = Request(record.id, prompt, token_ids, prepared.params)
        request.grammar_compile_ms = prepared.compile_ms
        return request


def merge_replicas(replicas: list[RunResult], prompt_order: list[str]) -> RunResult:
    """The data-parallel replicas' results as one run's: requests and outputs in prompt order, the
    summary over all of them (wall time: the slowest replica's), each replica's own summary kept."""
    position = {request_id: index for index, request_id in enumerate(prompt_order)}
    requests = sorted((r for replica in replicas for r in replica.requests), key=lambda r: position[r.request_id])
    results = sorted((line for replica in replicas for line in replica.results), key=lambda line: position[line["id"]])
    steps = [step for replica in replicas for step in replica.steps]
    total_s = max(replica.summary["total_s"] for replica in replicas)
    summary = summarize(requests, steps, 0.0, total_s) | {
        "data_parallel_replicas": [replica.summary for replica in replicas]
    }
    entries = [replica.summary["structured_output"] for replica in replicas if "structured_output" in replica.summary]
    if (structured := structured_output_summary(requests, ConstraintStats.summed(entries))) is not None:
        summary["structured_output"] = structured
    return RunResult(requests, results, steps, summary)


def log_structured_requests(requests: list[Request]) -> None:
    """Start-up: which requests are constrained, and how long each grammar took to compile."""
    for request in requests:
        params = request.sampling_params
        if params.structured_output is not None and request.grammar_compile_ms is not None:
            logger.info(
                "request %s: structured output %s, grammar compiled in %.2f ms",
                request.request_id,
                params.structured_output.describe(),
                request.grammar_compile_ms,
            )
        if params.bad_words:
            logger.info("request %s: bad words %s", request.request_id, list(params.bad_words))


def structured_output_summary(requests: list[Request], stats: ConstraintStats | None) -> dict[str, Any] | None:
    """summary.json's `structured_output`: the constrained requests, their grammars' compile times,
    and the host time masking took (per step with a constrained row); None when no request had one."""
    structured = [r for r in requests if r.sampling_params.structured_output is not None]
    banned = [r for r in requests if r.sampling_params.bad_words]
    if not structured and not banned:
        return None
    compile_ms = {r.request_id: r.grammar_compile_ms for r in structured if r.grammar_compile_ms is not None}
    return {
        "requests": [r.request_id for r in structured],
        "bad_words_requests": [r.request_id for r in banned],
        "compile_ms": compile_ms,
        "compile_ms_max": max(compile_ms.values(), default=0.0),
        **(stats.as_dict() if stats is not None else {}),
    }
