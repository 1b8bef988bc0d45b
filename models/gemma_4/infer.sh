#!/usr/bin/env bash
# Run a Gemma 4 (text) model: bash models/gemma_4/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/tiny_random.yaml" "$@"
