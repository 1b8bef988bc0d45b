#!/usr/bin/env bash
# What every models/<m>/infer.sh runs: bash scripts/run_model.sh <default yaml> [config.yaml] [--set section.key=value ...]
# The first argument after the default, unless it is an option, replaces the default config.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
yaml=${1:?usage: run_model.sh <default yaml> [config.yaml] [--set section.key=value ...]}
shift
if [[ $# -gt 0 && $1 != --* ]]; then yaml=$1; shift; fi
source "$root/scripts/setup.sh"
cd "$root"
exec "$PYTHON" -m executor.offline.launch --yaml "$yaml" "$@"
