"""Prefill-decode disaggregation (executor/online/disagg/): a prefill and a decode instance joined by
the real KV transfer (ZMQ control, a gloo pair group), here in one process: greedy output equal to
the offline run's token for token, for a tiny Llama (with C8 too) and the tiny random config of
every cache kind; the decode instance's received KV equal, block for block, to what a combined run
writes; faults (a prefill that never answers, a transfer that stalls mid-way, aborts) failing only
their requests and leaving both pools empty; retraction under memory pressure keeping the tokens."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
import torch

from executor.core.config import load_config
from executor.core.config.sections import DisaggConfig
from executor.offline.__main__ import load_records, resolve_model_path
from executor.offline.dataset import PromptRecord
from executor.offline.offline_inference import OfflineInference
from executor.online.disagg import transfer as transfer_module
from executor.online.disagg.kv_copy import KVCopier
from executor.online.disagg.loop import DisaggEngineLoop
from executor.online.disagg.scheduler import DisaggTicket
from executor.online.disagg.transfer import TRANSFER_ERROR
from executor.types_ import Request, SamplingParams
from tests.engine_harness import ENGINE_PROMPT_LENS, make_inference
from tests.online_harness import free_port
from tests.paged_harness import random_prompts
from tests.pd_harness import PDPair, pd_pair, pools_empty, wait

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(ENGINE_PROMPT_LENS, seed=7)


def offline_greedy(inference: OfflineInference, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    records = [PromptRecord(f"p{i}", prompt_token_ids=ids) for i, ids in enumerate(prompts)]
    for record in records:
        record.sampling_overrides["max_new_tokens"] = max_tokens
    return [request.output_token_ids for request in inference.generate(records).requests]


def check_pd_equals_offline(pair: PDPair, prompts: list[list[int]], expected: list[list[int]], max_tokens: int):
    outcomes = pair.generate(prompts, SamplingParams(max_new_tokens=max_tokens))
    assert [outcome.error for outcome in outcomes] == [None] * len(prompts)
    assert [outcome.token_ids for outcome in outcomes] == expected
    assert pools_empty(pair.prefill, pair.decode)
    assert pair.prefill.transfer_stats()["kv_transfers"] == len(prompts)
    assert pair.prefill.transfer_stats()["kv_held"] == 0


@pytest.fixture(scope="module")
def llama_pair(tiny_llama_dir):
    engines = [make_inference(tiny_llama_dir, max_new_tokens=MAX_TOKENS, batch_size=8).engine for _ in range(2)]
    with pd_pair(*engines, timeout_s=10) as pair:
        yield pair


def test_greedy_through_prefill_and_decode_equals_offline_and_the_pools_end_empty(llama_pair, tiny_llama_dir, prompts):
    expected = offline_greedy(make_inference(tiny_llama_dir, max_new_tokens=MAX_TOKENS), prompts, MAX_TOKENS)
    check_pd_equals_offline(llama_pair, prompts, expected, MAX_TOKENS)
    # one at a time too (a decode step of one request beside none transferring)
    for prompt, tokens in zip(prompts[:2], expected[:2], strict=True):
        assert llama_pair.generate([prompt], SamplingParams(max_new_tokens=MAX_TOKENS))[0].token_ids == tokens


def test_a_first_token_that_ends_the_request_ends_it_on_arrival(llama_pair, prompts):
    outcome = llama_pair.generate([prompts[2]], SamplingParams(max_new_tokens=1))[0]
    assert len(outcome.token_ids) == 1 and outcome.finish_reason == "length"
    assert pools_empty(llama_pair.prefill, llama_pair.decode)


def test_the_received_kv_equals_a_combined_runs_block_for_block(tiny_llama_dir, prompts):
    """The decode instance's blocks of a request, once its KV arrived, hold exactly what a combined
    engine's prefill of the same prompt writes into its own blocks."""
    prompt = prompts[5]  # 40 tokens: three blocks of 16
    combined = make_inference(tiny_llama_dir, max_new_tokens=2).engine
    seen: dict[str, tuple] = {}
    combined_scheduler = combined.core.scheduler
    release = combined_scheduler._release

    def keep_kv(request):  # read the combined run's blocks before they are freed
        rows = combined.kv_cache_manager.get_block_ids(request.request_id)
        seen["combined"] = KVCopier(combined.worker).gather(rows)
        release(request)

    combined_scheduler._release = keep_kv

    combined.core.add_request(Request("c", None, list(prompt), SamplingParams(max_new_tokens=1)))
    while combined.core.has_work():
        combined.core.step()
    engines = [make_inference(tiny_llama_dir, max_new_tokens=2).engine for _ in range(2)]
    decode_scheduler = engines[1].core.scheduler
    with pd_pair(*engines, timeout_s=10) as pair:
        scheduler = pair.decode.core.scheduler
        arrived = scheduler.kv_arrived

        def read_blocks(request_id, *args):
            rows = scheduler.kv_cache_manager.get_block_ids(request_id)
            seen["decode"] = KVCopier(pair.decode.engine.worker).gather(rows)
            return arrived(request_id, *args)

        scheduler.kv_arrived = read_blocks
        assert pair.generate([prompt], SamplingParams(max_new_tokens=2))[0].error is None
    assert decode_scheduler is not scheduler  # the role scheduler replaced the engine's
    combined_parts, decode_parts = split(*seen["combined"]), split(*seen["decode"])
    assert combined_parts.keys() == decode_parts.keys() and combined_parts
    for key, combined_blocks in combined_parts.items():
        assert decode_parts[key].shape == combined_blocks.shape == (3, 16, *combined_blocks.shape[2:])
        for block in range(3):
            written = min(len(prompt) - 16 * block, 16)  # the last block's tail was never written
            assert torch.equal(decode_parts[key][block, :written], combined_blocks[block, :written]), (key, block)


def split(metas, buffer) -> dict[str, torch.Tensor]:
    """A gathered buffer's parts by cache tensor, each [rows, entries, *shape]."""
    parts, offset = {}, 0
    for meta in metas:
        parts[meta.key] = buffer[offset : offset + meta.nbytes].view(getattr(torch, meta.dtype)).view(meta.shape)
        offset += meta.nbytes
    return parts


def test_c8_kv_with_its_scales_goes_across(tiny_llama_dir, prompts):
    model_config = {"quantization": "c8"}
    offline = make_inference(tiny_llama_dir, model_config=model_config, max_new_tokens=MAX_TOKENS)
    expected = offline_greedy(offline, prompts, MAX_TOKENS)
    engines = [
        make_inference(tiny_llama_dir, model_config=model_config, max_new_tokens=MAX_TOKENS, batch_size=8).engine
        for _ in range(2)
    ]
    assert any(
        tensor.dtype == torch.int8 for group in engines[0].worker.kv_cache_groups for tensor in group.spec.tensors
    )
    with pd_pair(*engines, timeout_s=10) as pair:
        check_pd_equals_offline(pair, prompts, expected, MAX_TOKENS)


# One family per cache kind: sliding windows (gpt-oss), MLA (DeepSeek-V3, and its int8 latent with
# scales under C8), the DSA indexer's keys (GLM-5), recurrent and conv states (Qwen3.5), compressed
# entries (DeepSeek-V4).
CACHE_KINDS = [
    pytest.param("gpt_oss", [], id="gpt_oss"),
    pytest.param("deepseek_v3", [], id="deepseek_v3"),
    pytest.param("deepseek_v3", ["model_config.quantization=c8"], id="deepseek_v3-c8"),
    pytest.param("glm_5", [], id="glm_5"),
    pytest.param("qwen3_5", [], id="qwen3_5"),
    pytest.param("deepseek_v4", [], id="deepseek_v4"),
]
TINY_SETTINGS = [
    "data_config.num_prompts=3",
    "scheduler_config.batch_size=4",
    "scheduler_config.max_model_len=1024",
    "model_config.device=cpu",
]


@pytest.mark.parametrize(("family", "settings"), CACHE_KINDS)
def test_every_cache_kind_goes_across_and_decodes_as_offline(family, settings, monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs' model_path is relative to the repository
    yaml = ROOT / "models" / family / "config" / "tiny_random.yaml"
    config = load_config(yaml, TINY_SETTINGS + settings)
    model_path = str(resolve_model_path(config))
    records = load_records(config)
    for record in records:
        record.sampling_overrides["max_new_tokens"] = 6
    offline = OfflineInference(config, model_path).generate(records).requests
    prompts = [request.prompt_token_ids for request in offline]
    expected = [request.output_token_ids for request in offline]
    assert all(prompts) and all(expected)
    engines = [OfflineInference(load_config(yaml, TINY_SETTINGS + settings), model_path).engine for _ in range(2)]
    if settings:
        assert any(t.dtype == torch.int8 for g in engines[0].worker.kv_cache_groups for t in g.spec.tensors)
    with pd_pair(*engines, timeout_s=30) as pair:
        check_pd_equals_offline(pair, prompts, expected, 6)


def test_a_prefill_that_never_comes_fails_the_request_alone_and_frees_its_blocks(tiny_llama_dir, prompts):
    engines = [make_inference(tiny_llama_dir, max_new_tokens=4, batch_size=2).engine for _ in range(2)]
    with pd_pair(*engines, timeout_s=1.5) as pair:
        start_s = time.monotonic()
        lost = pair.submit(prompts[3], SamplingParams(max_new_tokens=4), prefill=False)  # the decode half only
        served = pair.generate([prompts[1]], SamplingParams(max_new_tokens=4))[0]
        outcome = wait(lost, timeout_s=20)
        assert outcome.finish_reason == "error" and outcome.error.startswith(TRANSFER_ERROR)
        assert "transfer_timeout_s = 1.5 s" in outcome.error
        assert time.monotonic() - start_s < 10
        assert served.error is None and len(served.token_ids) == 4
        assert pools_empty(pair.prefill, pair.decode)


def test_a_transfer_that_stalls_mid_way_fails_its_request_and_the_next_one_meets_the_prefill_afresh(
    tiny_llama_dir, prompts, monkeypatch
):
    engines = [make_inference(tiny_llama_dir, max_new_tokens=4).engine for _ in range(2)]
    with pd_pair(*engines, timeout_s=2) as pair:
        assert pair.generate([prompts[0]], SamplingParams(max_new_tokens=4))[0].error is None
        original = transfer_module.PrefillTransfer._send

        def header_only(self, identity, prefilled):  # the prefill rank "dies" after the header
            self._reply(
                identity,
                {
                    "op": "kv",
                    "room": prefilled.room,
                    "first_token_ids": [5],
                    "logprobs": [],
                    "prompt_logprobs": [],
                    "metas": prefilled.metas,
                    "nbytes": prefilled.buffer.numel(),
                },
            )
            self._pairs.pop(identity, None)

        monkeypatch.setattr(transfer_module.PrefillTransfer, "_send", header_only)
        failed = pair.generate([prompts[1]], SamplingParams(max_new_tokens=4))[0]
        assert failed.finish_reason == "error" and failed.error.startswith(TRANSFER_ERROR)
        assert "receiving it from the prefill instance" in failed.error
        monkeypatch.setattr(transfer_module.PrefillTransfer, "_send", original)
        assert pools_empty(pair.prefill, pair.decode)
        again = pair.generate([prompts[1]], SamplingParams(max_new_tokens=4))[0]
        assert again.error is None and len(again.token_ids) == 4


def test_an_abort_while_the_kv_is_on_its_way_releases_both_sides(llama_pair, prompts):
    decode, prefill = llama_pair.decode, llama_pair.prefill
    updates = llama_pair.submit(prompts[5], SamplingParams(max_new_tokens=MAX_TOKENS), prefill=False)
    deadline = time.monotonic() + 10
    while not decode.core.scheduler.transferring:  # its blocks are held, its KV asked for
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert decode.core.scheduler.kv_cache_manager.block_pool.num_used_blocks > 0
    decode.abort(f"d{llama_pair._rooms}")
    assert wait(updates, timeout_s=10).finish_reason == "abort"
    assert pools_empty(prefill, decode)
    assert llama_pair.generate([prompts[0]], SamplingParams(max_new_tokens=3))[0].error is None


def test_retraction_under_memory_pressure_keeps_every_requests_tokens(tiny_llama_dir, prompts):
    """A decode pool too small for every request's whole length at once: running requests are
    retracted (the cheapest first), recomputed later, and their output is still the offline one."""
    long_prompts = [prompts[3], prompts[5], prompts[2], prompts[4]]  # 33, 40, 17, 8 tokens
    expected = offline_greedy(make_inference(tiny_llama_dir, max_new_tokens=24), long_prompts, 24)
    prefill = make_inference(tiny_llama_dir, max_new_tokens=24, batch_size=8, max_model_len=80).engine
    decode = make_inference(
        tiny_llama_dir, max_new_tokens=24, batch_size=8, max_model_len=80, num_blocks=12, num_reserved_decode_tokens=0
    ).engine
    with pd_pair(prefill, decode, timeout_s=10) as pair:
        outcomes = pair.generate(long_prompts, SamplingParams(max_new_tokens=24))
        assert [outcome.token_ids for outcome in outcomes] == expected
        assert pair.decode.transfer_stats()["retractions"] > 0
        assert pools_empty(pair.prefill, pair.decode)


def test_reserved_decode_tokens_hold_a_request_back_until_its_room_is_free(tiny_llama_dir, prompts):
    """With num_reserved_decode_tokens covering a whole pool's worth, the second request waits for
    the first to finish (no retraction), and both still come out as offline."""
    two = [prompts[3], prompts[5]]
    expected = offline_greedy(make_inference(tiny_llama_dir, max_new_tokens=8), two, 8)
    prefill = make_inference(tiny_llama_dir, max_new_tokens=8, batch_size=8, max_model_len=80).engine
    decode = make_inference(
        tiny_llama_dir, max_new_tokens=8, batch_size=8, max_model_len=80, num_blocks=8, num_reserved_decode_tokens=64
    ).engine
    with pd_pair(prefill, decode, timeout_s=10) as pair:
        assert [outcome.token_ids for outcome in pair.generate(two, SamplingParams(max_new_tokens=8))] == expected
        assert pair.decode.transfer_stats()["retractions"] == 0
        assert pools_empty(pair.prefill, pair.decode)


def test_the_transfer_threads_leave_no_queue_behind(llama_pair):
    assert llama_pair.decode.decode_transfer.arrivals.qsize() == 0
    with pytest.raises(queue.Empty):
        llama_pair.decode.decode_transfer.arrivals.get_nowait()


def test_a_dead_transfer_thread_stops_its_loop_with_the_reason(tiny_llama_dir, prompts):
    engines = [make_inference(tiny_llama_dir, max_new_tokens=4).engine for _ in range(2)]
    with pd_pair(*engines, timeout_s=5) as pair:
        pair.decode.decode_transfer.error = OSError("socket gone")
        outcome = wait(pair.submit(prompts[0], SamplingParams(max_new_tokens=4)), timeout_s=20)
        assert outcome.finish_reason == "error" and "KV transfer thread stopped: OSError: socket gone" in outcome.error
        assert pair.decode.error is not None


def test_a_decode_instance_that_starts_first_finds_the_prefill_instance_when_it_comes(tiny_llama_dir, prompts):
    """The decode half of a request names a bootstrap server that is not up yet: the decode
    instance keeps reading its route (bounded by the timeout) and meets the prefill instance once
    it starts; the output is the offline run's."""

    expected = offline_greedy(make_inference(tiny_llama_dir, max_new_tokens=5), [prompts[3]], 5)[0]
    port = free_port()
    decode = DisaggEngineLoop(make_inference(tiny_llama_dir).engine, 8, DisaggConfig("DECODE", transfer_timeout_s=20))
    prefill_engine = make_inference(tiny_llama_dir).engine
    decode.start()
    prefill = None
    try:
        updates: queue.Queue = queue.Queue()
        ticket = DisaggTicket("early", "127.0.0.1", port)
        decode.submit_disagg(
            Request("d", None, list(prompts[3]), SamplingParams(max_new_tokens=5)), updates.put, ticket
        )
        time.sleep(1.0)  # the decode side is already asking for a route no one serves
        prefill = DisaggEngineLoop(
            prefill_engine, 8, DisaggConfig("PREFILL", bootstrap_port=port, transfer_timeout_s=20)
        )
        prefill.start()
        prefill.submit_disagg(
            Request("p", None, list(prompts[3]), SamplingParams(max_new_tokens=5)), lambda u: None, ticket
        )
        outcome = wait(updates, timeout_s=30)
        assert outcome.error is None and outcome.token_ids == expected
    finally:
        decode.stop(timeout_s=15)
        if prefill is not None:
            prefill.stop(timeout_s=15)


PD_YAMLS = ROOT / "tests" / "data" / "cann_recipes" / "runs" / "deepseek_r1_pd"


def test_cann_recipes_pd_yamls_run_as_they_are_as_the_two_roles(monkeypatch):
    """The layout of cann-recipes' *_pd/prefill.yaml and decode.yaml (top-level model_name and
    world_size kept beside the sections, max_new_tokens 1 on the prefill side) loads as the role
    --pd-role names and serves: greedy output equal to the decode YAML's offline run."""
    monkeypatch.chdir(ROOT)
    device = ["model_config.device=cpu"]
    configs = {
        role: load_config(PD_YAMLS / f"{role}.yaml", [*device, f"disagg_config.disaggregation_mode={role.upper()}"])
        for role in ("prefill", "decode")
    }
    assert configs["prefill"].model_config.model_name == "deepseek_r1" == configs["decode"].model_config.model_name
    assert configs["prefill"].scheduler_config.max_new_tokens == 1
    model_path = str(resolve_model_path(configs["decode"]))
    offline = OfflineInference(load_config(PD_YAMLS / "decode.yaml", device), model_path)
    prompts = random_prompts((9, 30, 130), seed=3)  # the last spans two blocks of 128
    expected = offline_greedy(offline, prompts, 8)
    engines = [OfflineInference(configs[role], model_path).engine for role in ("prefill", "decode")]
    with pd_pair(*engines, timeout_s=30) as pair:
        check_pd_equals_offline(pair, prompts, expected, 8)


def test_a_kept_top_level_key_that_disagrees_with_its_section_is_refused():
    from executor.core.config import ConfigError, build_config

    with pytest.raises(
        ConfigError, match="world_size 2 at the top of t.yaml .* differs from parallel_config.world_size 1"
    ):
        build_config({"world_size": 2, "parallel_config": {"world_size": 1}}, source="t.yaml")
