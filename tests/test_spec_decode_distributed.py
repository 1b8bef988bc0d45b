"""Speculative decoding across processes (torchrun, gloo on CPU): greedy outputs equal to the
one-process run without speculation, and the accept counts of every replica summed into the one
summary.json, for n-gram and MTP drafts at attention TP 2 (EP 2 inside the TP group) and at DP 2 x
EP 2 (lock-step: the replicas' verify steps feed different row counts, and a replica whose requests
are done or draft less runs idle forwards and idle MTP passes), for a draft model at DP 2 x EP 2,
for n-gram drafts at TP 3, and for an EAGLE-3 drafter at attention TP 2 in eager and ge_graph; and
for MTP in ge_graph at both layouts, every step but prefills and the MTP passes after them in graphs
(in lock-step the replicas agree on each forward's bucket), and SmolLM2's own layers at TP 3 in
ge_graph with and without MTP.

The layouts of one world size run in one torchrun launch (tests/dist_runs_entry.py), so the ranks
start once. n-gram's counts are exact: the greedy outputs imply them (tests/spec_decode_harness.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from executor.core.spec_decode.ngram import NgramProposer
from executor.types_ import AcceptCounts
from scripts.make_layer_skip_draft import make_draft
from scripts.train_mtp_head import TrainableMTPLayer, load_frozen_model, save_model_folder
from tests.conftest import save_tiny_llama
from tests.deepseek_v3_harness import save_checkpoint
from tests.dist_harness import entry_args, parallel_overrides, run_in_one_launch, run_one_process, token_ids
from tests.factories import TINY_VOCAB, deepseek_config, tiny_tokenizer
from tests.run_harness import outputs_by_id, summary, write_run
from tests.spec_decode_harness import ngram_accept_counts
from tests.test_distributed import save_moe_folder
from tests.test_eagle3 import save_drafter

# Replica 0 serves r0 and r2, replica 1 r1 and r3: replica 0 is done first and idles while r1 drafts.
NEW_TOKENS = {"r0": 5, "r1": 12, "r2": 7, "r3": 4}
NGRAM = ["speculative_config.method=ngram", "speculative_config.num_speculative_tokens=3"]
NGRAM += ["speculative_config.prompt_lookup_min=1"]
NGRAM_PROPOSER = NgramProposer(num_speculative_tokens=3, min_n=1, max_n=4)  # the config's lookup
MTP = ["speculative_config.method=mtp", "speculative_config.num_speculative_tokens=2"]
# Everything split inside one replica; or attention DP 2 with the MoE, embedding and LM head across both.
TP_2 = parallel_overrides(2, attn_tp_size=2, moe_tp_size=1, dense_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)
DP_2_EP_2 = parallel_overrides(2, attn_tp_size=1, moe_tp_size=1, embed_tp_size=2, lmhead_tp_size=2)
LAYOUTS = {"tp2": TP_2, "dp2ep2": DP_2_EP_2}


def save_echoing_deepseek(path: Path) -> Path:
    """The tiny DeepSeek-V3 with one MTP module that proposes the token it reads again (eh_proj passes
    its normed embedding on, its block adds nothing, plain norms, its head the embedding), and a main
    model that tends to repeat its last token (its LM head tied to the embedding): drafts accepted in
    part (about 70% on write_repetitive_run's prompts), so the replicas' accept lengths differ."""
    save_checkpoint(path, deepseek_config(num_nextn_predict_layers=1))
    tiny_tokenizer().save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    hidden = embedding.shape[1]
    mtp = "model.layers.3."
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        mtp + "embed_tokens.weight",
        mtp + "shared_head.head.weight",
    ):
        tensors[name] = embedding.clone()
    tensors |= {mtp + name: torch.ones(hidden) for name in ("enorm.weight", "shared_head.norm.weight")}
    tensors[mtp + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    for name in tensors:
        if name.startswith(mtp) and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def save_echoing_eagle3_drafter(path: Path, model_dir: Path, tokens: list[int], echo: float) -> Path:
    """A random EAGLE-3 drafter (tests/test_eagle3.py) for a tiny Llama that repeats its last token
    (its LM head tied to the embedding), pulled towards proposing the token of its row: fc adds
    `echo` x the target's lowest layer's input (that token's embedding), and its head is the target's
    embedding over a draft vocabulary holding `tokens` (what the target repeats). Its drafts are
    accepted in part, each decided by fc, the layer, the head and d2t together."""
    target = LlamaConfig.from_pretrained(model_dir)
    save_drafter(path, target, seed=3, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
    tensors = load_file(str(path / "model.safetensors"))
    draft_vocab = tensors["d2t"].shape[0]
    others = [token for token in range(TINY_VOCAB) if token not in tokens]
    target_ids = torch.tensor(sorted([*set(tokens), *others][:draft_vocab]))
    tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    tensors["lm_head.weight"] = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"][target_ids]
    hidden = target.hidden_size
    tensors["fc.weight"][:, :hidden] += echo * torch.eye(hidden)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_repetitive_run(tmp_path: Path, model_dir: Path, model_name: str) -> Path:
    """write_run's YAML over 4 prompts that repeat a phrase (n-grams recur) 2 to 5 times, each with
    its own max_new_tokens (NEW_TOKENS)."""
    tmp_path.mkdir()
    run_yaml = write_run(tmp_path, model_dir, num_prompts=len(NEW_TOKENS))
    rng = random.Random(3)
    lines = []
    for index, (request_id, new_tokens) in enumerate(NEW_TOKENS.items()):
        phrase = [rng.randrange(3, 250) for _ in range(4)]
        prompt = phrase * (2 + index) + [rng.randrange(3, 250)]
        lines.append({"id": request_id, "prompt_token_ids": prompt, "max_new_tokens": new_tokens})
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if model_name:
        run_yaml.write_text(
            run_yaml.read_text().replace("model_config:\n", f"model_config:\n  model_name: {model_name}\n")
        )
    return run_yaml


def prompts_and_outputs(run_yaml: Path, reference: dict[str, dict]) -> list[tuple[list[int], list[int]]]:
    prompts = {
        line["id"]: line["prompt_token_ids"] for line in map(json.loads, (run_yaml.parent / "prompts.jsonl").open())
    }
    return [(prompts[request_id], line["output_token_ids"]) for request_id, line in reference.items()]


def replica_steps(out: Path) -> list[list[dict]]:
    """Each replica's step lines (steps.jsonl, then steps_dp1.jsonl, ...). In lock-step the replicas'
    steps pair up in order: idle forwards, which have no line, come only after a replica's work."""
    paths = sorted(out.glob("steps*.jsonl"))
    return [[json.loads(line) for line in path.read_text().splitlines()] for path in paths]


def step_counts(out: Path) -> AcceptCounts:
    """The accept counts of every replica's step lines."""
    counts = AcceptCounts()
    for steps in replica_steps(out):
        for line in steps:
            counts.add(AcceptCounts.from_step_line(line))
    return counts


def assert_summed(out: Path) -> dict:
    """summary.json's speculation counts are every replica's steps', and its replicas' summaries'."""
    whole = summary(out)
    spec = whole["speculative"]
    counts = step_counts(out)
    assert counts.num_drafted > 0 and spec["per_position"] == counts.per_position()
    assert (spec["draft_tokens"], spec["accepted_tokens"]) == (counts.num_drafted, counts.num_accepted)
    replicas = whole["parts"][-1].get("data_parallel_replicas")
    if replicas:
        by_position: dict[int, list[int]] = {}
        for replica in replicas:
            for entry in replica.get("speculative", {}).get("per_position", []):
                drafted_accepted = by_position.setdefault(entry["position"], [0, 0])
                drafted_accepted[0] += entry["draft_tokens"]
                drafted_accepted[1] += entry["accepted_tokens"]
        assert [by_position[position] for position in sorted(by_position)] == [
            [entry["draft_tokens"], entry["accepted_tokens"]] for entry in spec["per_position"]
        ]
    return spec


def verify_met_other_rows(out: Path) -> bool:
    """Lock-step: whether a verify step met a step of the other replica that fed another token count."""
    replica_0, replica_1 = replica_steps(out)
    return any(
        (a["num_draft_tokens"] or b["num_draft_tokens"]) and a["num_tokens"] != b["num_tokens"]
        for a, b in zip(replica_0, replica_1, strict=False)
    )


@pytest.mark.slow
def test_ngram_and_mtp_across_two_processes_give_one_process_tokens_and_summed_accept_counts(tmp_path):
    deepseek_dir = tmp_path / "deepseek_v3"
    save_checkpoint(deepseek_dir, deepseek_config(num_nextn_predict_layers=1))
    tiny_tokenizer().save_pretrained(deepseek_dir)
    qwen_dir = save_moe_folder(tmp_path / "qwen3_moe", "qwen3_moe")
    cases = {
        "deepseek_v3": (write_repetitive_run(tmp_path / "deepseek_v3_run", deepseek_dir, "deepseek_v3"), [NGRAM, MTP]),
        "qwen3_moe": (write_repetitive_run(tmp_path / "qwen3_moe_run", qwen_dir, "qwen3_moe"), [NGRAM]),
    }
    references, runs = {}, []
    for family, (run_yaml, methods) in cases.items():
        references[family] = run_one_process(run_yaml, tmp_path / f"{family}_one_process")
        for method in methods:
            for layout in LAYOUTS:
                out = tmp_path / f"{family}_{method[0].rpartition('=')[2]}_{layout}"
                runs.append((family, method, layout, out))
    # the target as its own draft model, whose experts span the replicas: its forwards keep lock-step too
    draft_model = ["speculative_config.method=draft_model", f"speculative_config.draft_model_path={deepseek_dir}"]
    draft_model += ["speculative_config.num_speculative_tokens=2"]
    runs.append(("deepseek_v3", draft_model, "dp2ep2", tmp_path / "deepseek_v3_draft_model_dp2ep2"))
    launch = run_in_one_launch(
        [entry_args(cases[family][0], out, [*method, *LAYOUTS[layout]]) for family, method, layout, out in runs],
        nproc=2,
        runs_file=tmp_path / "runs.json",
    )
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-4000:]
    mtp_one_process = run_one_process(cases["deepseek_v3"][0], tmp_path / "mtp_one_process", *MTP)
    mtp_counts = summary(tmp_path / "mtp_one_process")["speculative"]["per_position"]
    for family, method, layout, out in runs:
        run_yaml = cases[family][0]
        assert token_ids(outputs_by_id(out)) == token_ids(references[family]), out.name
        spec = assert_summed(out)
        if method is NGRAM:
            expected = ngram_accept_counts(prompts_and_outputs(run_yaml, references[family]), NGRAM_PROPOSER, 128)
            assert spec["per_position"] == expected.per_position(), out.name
        elif method is draft_model:
            assert len(spec["per_position"]) == 2 and spec["accept_rate"] == 1.0  # the target drafts its own tokens
        else:
            assert token_ids(mtp_one_process) == token_ids(references[family])
            assert spec["per_position"] == mtp_counts, out.name  # the same drafts as in one process
        if layout == "dp2ep2":
            replicas = summary(out)["parts"][-1]["data_parallel_replicas"]
            assert replicas[0]["lock_step_idle_steps"] > 0, out.name  # replica 0 idled while replica 1 drafted
            assert verify_met_other_rows(out), out.name


@pytest.mark.slow
def test_ngram_at_attention_tp_3_gives_one_process_tokens_and_exact_accept_counts(tmp_path):
    """A tiny Llama whose 6 query and 3 KV heads split 3 ways; the dense FFN too."""
    model_dir = save_tiny_llama(
        tmp_path / "llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96
    )
    run_yaml = write_repetitive_run(tmp_path / "run", model_dir, "")
    reference = run_one_process(run_yaml, tmp_path / "one_process")
    out = tmp_path / "tp3"
    sizes = parallel_overrides(3, attn_tp_size=3, dense_tp_size=3)
    launch = run_in_one_launch([entry_args(run_yaml, out, [*NGRAM, *sizes])], nproc=3, runs_file=tmp_path / "runs.json")
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-4000:]
    assert token_ids(outputs_by_id(out)) == token_ids(reference)
    spec = assert_summed(out)
    expected = ngram_accept_counts(prompts_and_outputs(run_yaml, reference), NGRAM_PROPOSER, 256)
    assert spec["per_position"] == expected.per_position()


def prefill_steps(out: Path) -> int:
    """The steps in which some replica prefills."""
    replicas = replica_steps(out)
    longest = max(map(len, replicas))
    return sum(any(i < len(steps) and steps[i]["phase"] == "prefill" for steps in replicas) for i in range(longest))


def verify_steps(graph: dict) -> int:
    return sum(n for bucket, n in graph["graph_steps_per_bucket"].items() if "x" in bucket)


@pytest.mark.slow
@pytest.mark.long  # 92 s; ge_graph + MTP + TP stay in CI through the TP 3 SmolLM2 test
def test_ge_graph_with_mtp_at_tp_2_and_in_lock_step_runs_every_step_but_prefills_in_graphs(tmp_path):
    """The flagship combination on the tiny DeepSeek-V3, MTP drafting in ge_graph: at attention TP 2
    (EP 2 inside the group) and at DP 2 x EP 2 (lock-step: the replicas' requests, prompt lengths and
    accept lengths differ, and a replica done first runs idle forwards and idle MTP passes) one
    process's tokens, with the verify steps, the idle forwards and every MTP pass but those after a
    prefill in graphs, on every rank."""
    deepseek_dir = save_echoing_deepseek(tmp_path / "deepseek_v3")
    run_yaml = write_repetitive_run(tmp_path / "run", deepseek_dir, "deepseek_v3")
    reference = run_one_process(run_yaml, tmp_path / "one_process")
    # steps of at most 2 requests, so that only the prefills (and the MTP passes after them) fit no graph
    graph = ["model_config.exe_mode=ge_graph", "scheduler_config.graph_buckets=[2]", "scheduler_config.batch_size=2"]
    runs = {layout: tmp_path / f"mtp_{layout}" for layout in ("tp2", "dp2ep2")}
    launch = run_in_one_launch(
        [entry_args(run_yaml, out, [*MTP, *graph, *LAYOUTS[layout]]) for layout, out in runs.items()],
        nproc=2,
        runs_file=tmp_path / "runs.json",
    )
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-4000:]
    for out in runs.values():
        assert token_ids(outputs_by_id(out)) == token_ids(reference), out.name
        assert_summed(out)
        part = summary(out)["parts"][-1]
        for graphs in [replica["graph"] for replica in part.get("data_parallel_replicas", [part])]:
            (mtp,) = graphs["mtp"].values()
            assert verify_steps(graphs) > 0 and verify_steps(mtp) > 0, out.name
            assert sum(mtp["graph_steps_per_bucket"].values()) > verify_steps(mtp), out.name  # drafts 2.. too
            assert graphs["eager_steps"] == mtp["eager_steps"] == prefill_steps(out), out.name
    replicas = summary(runs["dp2ep2"])["parts"][-1]["data_parallel_replicas"]
    assert replicas[0]["lock_step_idle_steps"] > 0  # replica 0 idled, in the graphs, while replica 1 drafted
    assert verify_met_other_rows(runs["dp2ep2"])


def save_smollm2_with_echoing_mtp(smollm2_dir: Path, path: Path, num_layers: int) -> Path:
    """SmolLM2's first `num_layers` layers with its real weights and head counts (9 query and 3 KV
    heads, which split 3 ways where the tiny configs' 4 do not), and one Llama MTP layer that proposes
    the token it reads again (eh_proj passes its normed embedding on, its block adds nothing, plain
    norms; the head is SmolLM2's, tied to the embedding): accepted where the model repeats a token."""
    truncated = make_draft(smollm2_dir, path.with_name(path.name + "_truncated"), num_layers)
    mtp = TrainableMTPLayer(load_frozen_model(truncated))
    hidden = mtp.eh_proj.weight.shape[0]
    with torch.no_grad():
        mtp.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
        for norm in (mtp.enorm, mtp.shared_head.norm):
            norm.weight.fill_(1.0)
        mtp.mtp_block.self_attn.o_proj.weight.zero_()
        mtp.mtp_block.mlp.down_proj.weight.zero_()
    save_model_folder(truncated, path, mtp.checkpoint_tensors(num_layers), {"echoing": True})
    return path


@pytest.mark.slow
def test_ge_graph_at_tp_3_on_smollm2_with_and_without_mtp_gives_one_process_tokens(smollm2_dir, tmp_path):
    """Every rank holds a third of each layer's heads and of the vocabulary; the decode, verify and
    MTP passes after a decode step all run in graphs, with the all-reduces and gathers inside them."""
    model_dir = save_smollm2_with_echoing_mtp(smollm2_dir, tmp_path / "smollm2_mtp", num_layers=2)
    run_yaml = write_repetitive_run(tmp_path / "run", model_dir, "")
    reference = run_one_process(run_yaml, tmp_path / "one_process")
    graph = ["model_config.exe_mode=ge_graph", "scheduler_config.graph_buckets=[2]", "scheduler_config.batch_size=2"]
    sizes = parallel_overrides(3, attn_tp_size=3, dense_tp_size=3, embed_tp_size=3, lmhead_tp_size=3)
    runs = {"plain": (tmp_path / "tp3", []), "mtp": (tmp_path / "tp3_mtp", MTP)}
    launch = run_in_one_launch(
        [entry_args(run_yaml, out, [*method, *graph, *sizes]) for out, method in runs.values()],
        nproc=3,
        runs_file=tmp_path / "runs.json",
    )
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-4000:]
    for out, _ in runs.values():
        assert token_ids(outputs_by_id(out)) == token_ids(reference), out.name
    plain = summary(runs["plain"][0])["parts"][-1]["graph"]
    assert plain["graph_steps_per_bucket"]["2"] > 0 and plain["eager_steps"] == prefill_steps(runs["plain"][0])
    out = runs["mtp"][0]
    spec = assert_summed(out)
    assert spec["accepted_tokens"] > 0
    graphs = summary(out)["parts"][-1]["graph"]
    (mtp,) = graphs["mtp"].values()
    assert verify_steps(graphs) > 0 and verify_steps(mtp) > 0
    assert graphs["eager_steps"] == mtp["eager_steps"] == prefill_steps(out)


@pytest.mark.slow
def test_eagle3_at_attention_tp_2_in_eager_and_ge_graph_drafts_as_one_process_and_keeps_its_tokens(tmp_path):
    """The tiny Llama with its heads, FFN, embedding and LM head split 2 ways, and an EAGLE-3 drafter
    whose layer splits with them (fc and its draft-vocabulary head whole on each rank): speculation
    off's tokens, and one eager process's drafts (its accept counts at every position, which the
    batching does not change), in eager and with the target's and the drafter's passes in graphs,
    where a verify bucket pads each request to 1 + k rows and the drafter must read the target's
    hidden states at the step's own."""
    model_dir = save_tiny_llama(tmp_path / "llama", tie_word_embeddings=True)
    run_yaml = write_repetitive_run(tmp_path / "run", model_dir, "")
    prompts = [json.loads(line)["prompt_token_ids"] for line in (tmp_path / "run" / "prompts.jsonl").open()]
    drafter = save_echoing_eagle3_drafter(tmp_path / "drafter", model_dir, [p[-1] for p in prompts], echo=30.0)
    eagle3 = ["speculative_config.method=eagle3", "speculative_config.num_speculative_tokens=3"]
    eagle3 += [f"speculative_config.draft_model_path={drafter}"]
    lookup = ["speculative_config.prompt_lookup=true"]  # the lookup's drafts where an n-gram recurs
    reference = run_one_process(run_yaml, tmp_path / "one_process")
    eagle3_one_process = run_one_process(run_yaml, tmp_path / "eagle3_one_process", *eagle3)
    lookup_one_process = run_one_process(run_yaml, tmp_path / "lookup_one_process", *eagle3, *lookup)
    graph = ["model_config.exe_mode=ge_graph", "scheduler_config.graph_buckets=[2]", "scheduler_config.batch_size=2"]
    sizes = parallel_overrides(2, attn_tp_size=2, dense_tp_size=2, embed_tp_size=2, lmhead_tp_size=2)
    runs = {tmp_path / "tp2": [], tmp_path / "tp2_ge_graph": graph, tmp_path / "tp2_lookup": lookup}
    launch = run_in_one_launch(
        [entry_args(run_yaml, out, [*eagle3, *mode, *sizes]) for out, mode in runs.items()],
        nproc=2,
        runs_file=tmp_path / "runs.json",
    )
    assert launch.returncode == 0, (launch.stdout + launch.stderr)[-4000:]
    assert "EAGLE-3 drafter from" in launch.stdout + launch.stderr
    expected = summary(tmp_path / "eagle3_one_process")["speculative"]
    expected_with_lookup = summary(tmp_path / "lookup_one_process")["speculative"]
    assert token_ids(eagle3_one_process) == token_ids(lookup_one_process) == token_ids(reference)
    assert 0 < expected["accepted_tokens"] < expected["draft_tokens"]
    assert expected_with_lookup["looked_up"]["verifies"] > 0
    for out in runs:
        assert token_ids(outputs_by_id(out)) == token_ids(reference), out.name
        one_process = expected_with_lookup if out.name == "tp2_lookup" else expected
        assert assert_summed(out)["per_position"] == one_process["per_position"], out.name
        assert summary(out)["parts"][-1]["speculative"]["method"] == "eagle3"
    assert summary(tmp_path / "tp2_lookup")["speculative"]["looked_up"] == expected_with_lookup["looked_up"]
    graphs = summary(tmp_path / "tp2_ge_graph")["parts"][-1]["graph"]
    assert verify_steps(graphs) > 0 and sum(graphs["eagle3"]["eagle3"]["graph_steps_per_bucket"].values()) > 0
