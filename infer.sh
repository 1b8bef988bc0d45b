#!/usr/bin/env bash
# The default job: SmolLM2-135M-Instruct over dataset/default.jsonl. Sets itself up on first run.
exec bash "$(dirname "${BASH_SOURCE[0]}")/models/llama/infer.sh" "$@"
