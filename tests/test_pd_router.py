"""The Router in front of a prefill and a decode server (each its own engine, in this process), as
clients use it: greedy completions, chat and streams equal to a combined server's; /health and
/v1/models; a prefill instance that is down gets the client a 503 and leaves the decode pool empty;
the role servers refuse a request that did not come through the Router."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from executor.core.config.sections import DisaggConfig
from tests.engine_harness import ENGINE_PROMPT_LENS
from tests.online_harness import free_port, health_ok, routing, serving
from tests.paged_harness import random_prompts
from tests.pd_harness import pools_empty

MAX_TOKENS = 10
SCHEDULER = {"batch_size": 8, "max_new_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(ENGINE_PROMPT_LENS, seed=11)


@pytest.fixture(scope="module")
def combined(tiny_llama_dir):
    with serving(tiny_llama_dir, **SCHEDULER) as running:
        yield running


@pytest.fixture(scope="module")
def pd(tiny_llama_dir):
    """(router base URL, prefill server, decode server)."""
    prefill_config = DisaggConfig("PREFILL", bootstrap_port=0, transfer_timeout_s=5)
    with serving(tiny_llama_dir, disagg=prefill_config, **SCHEDULER) as prefill:
        bootstrap_port = prefill.loop.bootstrap_info()["bootstrap_port"]
        decode_config = DisaggConfig("DECODE", bootstrap_port=bootstrap_port, transfer_timeout_s=5)
        with serving(tiny_llama_dir, disagg=decode_config, **SCHEDULER) as decode:
            urls = [server.base_url.removesuffix("/v1") for server in (prefill, decode)]
            with routing([urls[0]], [urls[1]]) as router_url:
                yield router_url, prefill, decode


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)


def complete(base_url: str, prompt: list[int], **kwargs) -> openai.types.Completion:
    return client(base_url).completions.create(
        model="default",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
        **kwargs,
    )


def test_completions_through_the_router_equal_the_combined_servers(pd, combined, prompts):
    router_url, prefill, decode = pd
    for prompt in prompts:
        ours, theirs = complete(router_url, prompt), complete(combined.base_url, prompt)
        assert ours.choices[0].token_ids == theirs.choices[0].token_ids
        assert ours.choices[0].text == theirs.choices[0].text
        assert ours.usage.completion_tokens == theirs.usage.completion_tokens
    assert pools_empty(prefill.loop, decode.loop)


def test_n_choices_each_take_a_room_of_their_own(pd, combined, prompts):
    router_url, _, _ = pd
    ours = complete(router_url, prompts[3], n=2)
    theirs = complete(combined.base_url, prompts[3], n=2)
    assert [choice.token_ids for choice in ours.choices] == [choice.token_ids for choice in theirs.choices]


def test_chat_and_streams_through_the_router_equal_the_combined_servers(pd, combined):
    router_url, _, _ = pd
    messages = [{"role": "user", "content": "hello there"}]
    ours = client(router_url).chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0)
    theirs = client(combined.base_url).chat.completions.create(
        model="default", messages=messages, max_tokens=6, temperature=0
    )
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    stream = client(router_url).chat.completions.create(
        model="default", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    assert (
        "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        == theirs.choices[0].message.content
    )


def test_generate_health_and_models_through_the_router(pd, prompts):
    router_url, _, _ = pd
    base = router_url.removesuffix("/v1")
    assert httpx.get(base + "/health").status_code == 200
    assert [model["id"] for model in httpx.get(router_url + "/models").json()["data"]] == ["default"]
    answer = httpx.post(base + "/generate", json={"input_ids": prompts[1], "sampling_params": {"max_new_tokens": 4}})
    assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 4


def test_a_role_server_refuses_a_request_that_did_not_come_through_the_router(pd, prompts):
    _, prefill, decode = pd
    for server in (prefill, decode):
        answer = httpx.post(server.base_url + "/completions", json={"prompt": prompts[0], "max_tokens": 2})
        assert answer.status_code == 400
        assert "bootstrap_room" in answer.json()["error"]["message"]


def test_a_prefill_instance_that_is_down_gets_a_503_and_the_decode_pool_stays_empty(pd, prompts):
    _, _, decode = pd
    dead = f"http://127.0.0.1:{free_port()}"
    with routing([dead], [decode.base_url.removesuffix("/v1")]) as router_url:
        answer = httpx.post(router_url + "/completions", json={"prompt": prompts[0], "max_tokens": 2}, timeout=30)
        assert answer.status_code == 503
        assert dead in answer.json()["error"]["message"]
        assert httpx.get(router_url.removesuffix("/v1") + "/health").status_code == 503
    assert pools_empty(decode.loop)


def test_a_decode_instance_reports_its_transfers_in_stats(pd, prompts):
    router_url, prefill, decode = pd
    complete(router_url, prompts[2])
    stats = httpx.get(decode.base_url.removesuffix("/v1") + "/stats").json()
    assert stats["kv_transfers"] >= 1 and stats["kv_transfer_bytes"] > 0
    assert (
        json.loads(json.dumps(httpx.get(prefill.base_url.removesuffix("/v1") + "/bootstrap_info").json()))["role"]
        == "prefill"
    )


def test_the_entry_refuses_a_role_it_cannot_run_before_loading_and_port_0_picks_one(tiny_llama_dir, capsys, tmp_path):
    from executor.core.config import ConfigError, build_config
    from executor.offline.exit_status import COULD_NOT_START
    from executor.online.__main__ import check_disaggregation, check_port, main

    def config(mode: str, **parallel: int):
        return build_config({"parallel_config": parallel, "disagg_config": {"disaggregation_mode": mode}})

    with pytest.raises(ConfigError, match="disaggregation_mode DECODE .* one rank or data-parallel replicas"):
        check_disaggregation(config("DECODE", world_size=2, attn_tp_size=2))  # (each rank says it before loading)
    with pytest.raises(ConfigError, match="disaggregation_mode PREFILL .* one attention tensor-parallel group"):
        check_disaggregation(config("PREFILL", world_size=2))  # two replicas
    check_disaggregation(config("DECODE", world_size=2))  # data-parallel replicas
    check_disaggregation(config("PREFILL", world_size=2, attn_tp_size=2))  # each rank a share of the KV heads
    config = tmp_path / "pd.yaml"
    config.write_text(f"model_config:\n  model_path: {tiny_llama_dir}\n  device: cpu\n")
    speculating = ["--set", "speculative_config.method=ngram", "--set", "speculative_config.num_speculative_tokens=2"]
    assert main(["--yaml", str(config), "--pd-role", "prefill", "--port", "0", *speculating]) == COULD_NOT_START
    assert "speculative decoding (ngram) is not built with disaggregation" in capsys.readouterr().err
    assert check_port("127.0.0.1", 0) > 0


def test_the_router_keys_are_refused_where_no_router_can_start(tiny_llama_dir):
    from executor.core.config import ConfigError, build_config
    from executor.online.__main__ import check_disaggregation

    def config(mode: str, **disagg):
        return build_config({"disagg_config": {"disaggregation_mode": mode, **disagg}})

    with pytest.raises(ConfigError, match="router_port 0 .* the decode leader starts the Router .*PREFILL instance"):
        check_disaggregation(config("PREFILL", router_port=0, router_prefill_urls=["http://127.0.0.1:1"]))
    with pytest.raises(ConfigError, match="router_prefill_urls .* needs the prefill instances"):
        check_disaggregation(config("DECODE", router_port=0))
    with pytest.raises(ConfigError, match="router_prefill_urls .* '127.0.0.1:1' is not an http:// URL"):
        check_disaggregation(config("DECODE", router_port=0, router_prefill_urls=["127.0.0.1:1"]))
    check_disaggregation(config("DECODE", router_port=0, router_prefill_urls=["http://127.0.0.1:1"]))


def test_the_router_a_decode_leader_starts_beside_itself_routes_as_the_router_does(pd, prompts):
    from executor.online.__main__ import router_beside

    router_url, prefill, decode = pd
    port = free_port()
    urls = [server.base_url.removesuffix("/v1") for server in (prefill, decode)]
    with router_beside("127.0.0.1", port, [urls[0]], urls[1]) as process:
        deadline = time.monotonic() + 60
        while not health_ok(f"http://127.0.0.1:{port}/health"):
            assert process.poll() is None and time.monotonic() < deadline, "the Router did not come up"
            time.sleep(0.2)
        beside = complete(f"http://127.0.0.1:{port}/v1", prompts[0]).choices[0]
        assert beside.token_ids == complete(router_url, prompts[0]).choices[0].token_ids
        assert len(beside.token_ids) == MAX_TOKENS
    assert process.returncode is not None  # stopped with the leader
    assert pools_empty(prefill.loop, decode.loop)


def test_the_router_refuses_what_it_cannot_route(capsys):
    from executor.online.router import main

    assert main(["--prefill", "http://127.0.0.1:1"]) == 2
    assert "at least one --prefill and one --decode" in capsys.readouterr().err
    assert main(["--prefill", "127.0.0.1:1", "--decode", "http://127.0.0.1:2"]) == 2
    assert "an http:// URL" in capsys.readouterr().err
