#!/usr/bin/env bash
# Run a Llama-family model: bash models/llama/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/smollm2_135m.yaml" "$@"
