#!/usr/bin/env bash
# Run a DeepSeek-V3.2-style model: bash models/deepseek_v3_2/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/tiny_random.yaml" "$@"
