#!/usr/bin/env bash
# Run a Qwen3.5-MoE model: bash models/qwen3_5_moe/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/tiny_random.yaml" "$@"
