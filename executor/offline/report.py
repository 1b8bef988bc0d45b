"""The report of a finished (or stopped) run, redrawn from its folder at any time:

python -m executor.offline.report RUN_FOLDER                 # RUN_FOLDER/steps.png and the breakdown
python -m executor.offline.report --compare BEFORE AFTER [--out PNG]   # time and accuracy of two runs

Everything is recomputed from steps.jsonl (and summary.json where it says more), so folders made
before a change to the summary still report, and two folders compare on the same rules. A
comparison also sets the runs' outputs side by side (executor/offline/run_agreement.py): how many
requests give identical tokens, where the others part, and how far their logprobs and prompt
logprobs move; `--out` draws both halves into a PNG outside the two run folders.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from executor.core.engine import PARTS
from executor.offline.durable_io import CorruptLineError, read_jsonl
from executor.offline.metrics import breakdown_lines, step_breakdown
from executor.offline.run_agreement import AgreementError, RunAgreement, agreement_lines, compare_outputs, read_outputs
from executor.offline.run_folder import (
    CONFIG_FILE,
    OUTPUTS_FILE,
    STEPS_FILE,
    SUMMARY_FILE,
    changed_settings,
    read_output_settings,
)
from executor.offline.summary_table import summary_lines

PLOT_FILE = "steps.png"
BAD_FOLDER = 2  # the exit status, as for argparse's usage errors
RUN_FIGURES = ("output_tokens_per_s", "ttft_mean_ms", "tpot_mean_ms")  # compared from summary.json


class ReportError(Exception):
    """A folder that cannot be reported on; the message names it."""


@dataclass(slots=True)
class RunFolder:
    path: Path
    steps: list[dict[str, Any]]  # steps.jsonl, in run order
    summary: dict[str, Any]  # summary.json; empty when missing or unreadable
    outputs: dict[str, dict[str, Any]]  # outputs.jsonl by request id; empty when missing
    settings: dict[str, Any] | None = None  # config.yaml's settings that change outputs; None when unreadable

    @property
    def breakdown(self) -> dict[str, Any]:
        return step_breakdown(self.steps)


def load_run_folder(path: Path) -> RunFolder:
    if not path.is_dir():
        raise ReportError(f"{path} is not a folder")
    try:
        steps = read_jsonl(path / STEPS_FILE).lines
    except (OSError, CorruptLineError) as exc:
        raise ReportError(f"{path}: {STEPS_FILE} cannot be read ({exc})") from None
    if not steps:
        raise ReportError(f"{path} is not a run folder with steps: {STEPS_FILE} is missing or empty")
    for line_no, step in enumerate(steps, start=1):
        if not isinstance(step.get("step"), int) or not isinstance(step.get("step_time_ms"), (int, float)):
            raise ReportError(f"{path / STEPS_FILE}:{line_no} is not a step line (no step or step_time_ms)")
    try:
        summary = json.loads((path / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    try:
        outputs = read_outputs(path) if (path / OUTPUTS_FILE).exists() else {}
    except AgreementError as exc:
        raise ReportError(str(exc)) from None
    return RunFolder(path, steps, summary if isinstance(summary, dict) else {}, outputs, _read_settings(path))


def _read_settings(path: Path) -> dict[str, Any] | None:
    try:
        return read_output_settings(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return None


def plot_steps(run: RunFolder, png_path: Path) -> None:
    """Step time across the run (its parts stacked where timed; prefill and decode steps marked)
    above batch size and KV cache use (second axis); dashed lines where a resumed part begins."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    from matplotlib.ticker import MaxNLocator

    steps = run.steps
    x = list(range(1, len(steps) + 1))
    figure = Figure(figsize=(12, 7), layout="constrained")
    time_ax, load_ax = figure.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    parts = [part for part in PARTS if any(part in (s.get("parts_ms") or {}) for s in steps)]
    if parts:
        stacks = [[(s.get("parts_ms") or {}).get(part, 0.0) for s in steps] for part in parts]
        time_ax.stackplot(x, *stacks, labels=parts, alpha=0.45)
    for phase, marker, color in (("prefill", "^", "tab:red"), ("decode", "o", "tab:blue")):
        at = [i for i, s in zip(x, steps, strict=True) if s.get("phase") == phase]
        time_ax.scatter(at, [steps[i - 1]["step_time_ms"] for i in at], marker=marker, s=14, color=color, label=phase)
    profiled = [i for i, s in zip(x, steps, strict=True) if s.get("profiled")]
    if profiled:
        times = [steps[i - 1]["step_time_ms"] for i in profiled]
        time_ax.scatter(profiled, times, marker="x", s=40, color="black", label="profiled (left out)")
    time_ax.set_ylabel("step time (ms)")
    time_ax.legend(loc="upper right", fontsize="small", ncols=2)
    load_ax.step(x, [s.get("batch_size", 0) for s in steps], where="mid", color="tab:green", label="batch size")
    load_ax.set_ylabel("batch size", color="tab:green")
    load_ax.set_ylim(bottom=0)
    load_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    load_ax.set_xlabel(f"step of the run ({STEPS_FILE} order)")
    kv_ax = load_ax.twinx()
    kv_ax.plot(x, [100 * s.get("kv_usage", 0.0) for s in steps], color="tab:purple")
    kv_ax.set_ylabel("KV cache use (%)", color="tab:purple")
    kv_ax.set_ylim(0, 100)
    for i in range(1, len(steps)):
        if steps[i].get("part") != steps[i - 1].get("part"):
            for ax in (time_ax, load_ax):
                ax.axvline(x[i] - 0.5, color="grey", linestyle="--", linewidth=0.8)
    figure.suptitle(str(run.path))
    figure.savefig(png_path, dpi=100)


def report_lines(run: RunFolder) -> list[str]:
    """The end table of summary.json's figures, then the breakdown recomputed from the steps."""
    return [f"=== {run.path}", *summary_lines(run.summary, run.path / SUMMARY_FILE), *breakdown_lines(run.breakdown)]


def compare_lines(before: RunFolder, after: RunFolder) -> list[str]:
    """Per phase and part, the mean before and after (outliers left out alike), the change and
    the change in percent; then the run figures of summary.json; then, where both runs have
    outputs, their agreement over the requests whose prompt token ids agree (ReportError when none do).
    The settings that change outputs and differ between the runs come first."""
    agreement = _agreement(before, after)
    lines = [f"before: {before.path}", f"after:  {after.path}", settings_line(before, after)]
    header = f"{'before':>12s} {'after':>12s} {'delta':>12s} {'delta %':>9s}"
    old, new = before.breakdown, after.breakdown
    for phase in [p for p in ("prefill", "decode") if p in old or p in new]:
        old_parts = old.get(phase, {}).get("parts", {})
        new_parts = new.get(phase, {}).get("parts", {})
        lines.append(f"{phase + ' mean ms':22s} {header}")
        for part in [p for p in (*PARTS, "total") if p in old_parts or p in new_parts]:
            means = (parts.get(part, {}).get("mean_ms") for parts in (old_parts, new_parts))
            lines.append(_delta_line(f"  {part}", *means))
    lines.append(f"{'run':22s} {header}")
    for key in RUN_FIGURES:
        lines.append(_delta_line(f"  {key}", before.summary.get(key), after.summary.get(key)))
    if agreement is not None:
        lines.extend(agreement_lines(agreement))
    return lines


def settings_line(before: RunFolder, after: RunFolder) -> str:
    """Which settings that change outputs (docs/resuming.md) differ between the two runs' config.yaml."""
    if before.settings is None or after.settings is None:
        unread = [str(run.path / CONFIG_FILE) for run in (before, after) if run.settings is None]
        return f"settings: not compared ({', '.join(unread)} missing or unreadable)"
    changed = changed_settings(before.settings, after.settings)
    return f"settings that differ: {'; '.join(changed)}" if changed else "settings: the same"


def _agreement(before: RunFolder, after: RunFolder) -> RunAgreement | None:
    """The runs' agreement where both have outputs; a ReportError when no request of both has the
    same prompt token ids in both (they are not runs of the same prompts)."""
    if not (before.outputs and after.outputs):
        return None
    agreement = compare_outputs(before.outputs, after.outputs)
    if agreement.compared + agreement.failed == 0:
        shared = len(before.outputs.keys() & after.outputs.keys())
        raise ReportError(
            f"{before.path} and {after.path} share no request with the same prompt token ids ({shared} ids in "
            f"both, {len(agreement.other_prompts)} of them with other prompts): not runs of the same prompts, "
            "nothing to compare"
        )
    return agreement


def plot_comparison(before: RunFolder, after: RunFolder, png_path: Path) -> None:
    """Both runs' step times across the run, above where each request's tokens first part (identical
    requests at their full length)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 7), layout="constrained")
    time_ax, parted_ax = figure.subplots(2, 1, height_ratios=[3, 2])
    for run, label in ((before, "before"), (after, "after")):
        time_ax.plot([s["step_time_ms"] for s in run.steps], label=f"{label}: {run.path}", linewidth=0.9)
    time_ax.set_xlabel("step")
    time_ax.set_ylabel("step time (ms)")
    time_ax.legend(loc="upper right", fontsize="small")
    agreement: RunAgreement = compare_outputs(before.outputs, after.outputs)
    ids = sorted(before.outputs.keys() & after.outputs.keys())
    lengths = [len(before.outputs[i].get("output_token_ids") or []) for i in ids]
    parted = [agreement.first_difference.get(i, length) for i, length in zip(ids, lengths, strict=True)]
    parted_ax.bar(range(len(ids)), lengths, color="lightgrey", label="generated tokens")
    parted_ax.bar(range(len(ids)), parted, color="tab:blue", label="identical before the first difference")
    parted_ax.set_xlabel(f"request ({agreement.identical} of {agreement.compared} identical)")
    parted_ax.set_ylabel("tokens")
    parted_ax.legend(loc="upper right", fontsize="small")
    figure.savefig(png_path, dpi=100)


def _check_outside(png_path: Path, folders: list[Path]) -> None:
    """A comparison is not written into either run's folder (a finished run's files stay as they are)."""
    target = png_path.resolve().parent
    for folder in folders:
        if target == folder.resolve() or folder.resolve() in target.parents:
            raise ReportError(f"--out {png_path} is inside the run folder {folder}: give a path outside it")


def _delta_line(label: str, before: float | None, after: float | None) -> str:
    if before is None or after is None:
        shown = [f"{v:12.3f}" if v is not None else f"{'-':>12s}" for v in (before, after)]
        return f"{label:22s} {shown[0]} {shown[1]} {'-':>12s} {'-':>9s}"
    percent = f"{100 * (after - before) / before:+8.1f}%" if before else f"{'-':>9s}"
    return f"{label:22s} {before:12.3f} {after:12.3f} {after - before:+12.3f} {percent}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.offline.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_folder", nargs="?", type=Path, help="a run's output folder: writes steps.png in it")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="two run folders")
    parser.add_argument("--out", type=Path, help="with --compare: a PNG to draw the comparison into")
    args = parser.parse_args(argv)
    if (args.run_folder is None) == (args.compare is None):
        parser.error("give one run folder, or --compare BEFORE AFTER")
    if args.out is not None and args.compare is None:
        parser.error("--out goes with --compare")
    try:
        if args.compare:
            runs = [load_run_folder(path) for path in args.compare]
            print("\n".join(compare_lines(*runs)))
            if args.out is not None:
                _check_outside(args.out, args.compare)
                plot_comparison(*runs, args.out)
                print(f"comparison drawn in {args.out}")
            return 0
        run = load_run_folder(args.run_folder)
        plot_steps(run, run.path / PLOT_FILE)
    except (ReportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_FOLDER
    print("\n".join([*report_lines(run), f"plot written to {run.path / PLOT_FILE}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
