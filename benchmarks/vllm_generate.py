"""vLLM's offline LLM.generate on given token ids, timed: run by bench_vs_transformers.py with the
Python of a separate virtualenv that has vLLM (docs/benchmarks.md says how to make one).

Reads one JSON object on stdin (model_path, dtype, batch_size, max_new_tokens, prompts: lists of
token ids) and prints one JSON object on stdout. Imports nothing of this project, so that it runs
in vLLM's environment as it is.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    load_start = time.perf_counter()
    llm = LLM(
        model=job["model_path"],
        dtype=job["dtype"],
        max_num_seqs=job["batch_size"],  # at most batch_size requests decode together, as ours and transformers
        max_model_len=job["max_model_len"],
        seed=0,
    )
    load_s = time.perf_counter() - load_start
    params = SamplingParams(temperature=0, max_tokens=job["max_new_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, as the other systems get
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(completion.token_ids) for output in outputs for completion in output.outputs)
    print(
        json.dumps(
            {
                "output_tokens": output_tokens,
                "total_s": elapsed,
                "output_tokens_per_s": output_tokens / elapsed,
                "load_s": load_s,
                "outputs": [list(output.outputs[0].token_ids) for output in outputs],
            }
        )
    )


if __name__ == "__main__":
    main()
