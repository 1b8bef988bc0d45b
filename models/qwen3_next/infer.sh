#!/usr/bin/env bash
# Run a Qwen3-Next model: bash models/qwen3_next/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/tiny_random.yaml" "$@"
