"""The online server on a tiny random Llama, through the `openai` client as evaluation tools use it:
greedy output equal to the offline run's, streaming, echo logprobs, bad input, aborts and the pool."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from executor.offline.dataset import PromptRecord
from executor.online.engine_loop import Update
from executor.types_ import Request, SamplingParams
from tests.engine_harness import ENGINE_PROMPT_LENS, make_inference
from tests.online_harness import printed, server_process, serving
from tests.paged_harness import random_prompts

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(ENGINE_PROMPT_LENS, seed=7)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir, prompts):
    """The offline run of the same prompts: its requests by id."""
    records = [
        PromptRecord(
            f"p{i}", prompt_token_ids=ids, sampling_overrides={"max_new_tokens": MAX_TOKENS, "prompt_logprobs": 2}
        )
        for i, ids in enumerate(prompts)
    ]
    result = make_inference(tiny_llama_dir, max_new_tokens=MAX_TOKENS).generate(records)
    return {request.request_id: request for request in result.requests}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with serving(tiny_llama_dir, served_model_name="tiny", batch_size=8, max_new_tokens=MAX_TOKENS) as running:
        yield running


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="EMPTY", max_retries=0)


def complete(client: openai.OpenAI, prompt: list[int], **kwargs) -> openai.types.Completion:
    body = {"return_token_ids": True} | kwargs.pop("extra_body", {})
    settings = {"model": "default", "max_tokens": MAX_TOKENS, "temperature": 0} | kwargs
    return client.completions.create(prompt=prompt, extra_body=body, **settings)


def test_greedy_completions_equal_the_offline_run_one_at_a_time_and_all_at_once(client, prompts, offline):
    one_by_one = [complete(client, prompt).choices[0] for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = [c.choices[0] for c in pool.map(lambda p: complete(client, p), prompts)]
    for i, (alone, concurrent) in enumerate(zip(one_by_one, together, strict=True)):
        expected = offline[f"p{i}"]
        assert alone.token_ids == expected.output_token_ids, f"prompt {i}"
        assert concurrent.token_ids == expected.output_token_ids, f"prompt {i} among others"
        assert alone.finish_reason == expected.finish_reason.value


def test_a_request_arriving_while_others_decode_joins_them_at_the_next_step(server, prompts, offline):
    """Continuous batching, at the engine loop the handlers submit to: a request submitted while
    another decodes is prefilled at the next step, then decodes beside it and finishes first."""
    steps: list[tuple[int, list[str]]] = []  # (batch size, finished request ids) per step
    arrived_at_step: list[int] = []
    server.loop.on_step = lambda step: steps.append((step.record.batch_size, [r.request_id for r in step.finished]))
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    server.loop.submit(Request("long", None, prompts[5], params), lambda update: None)
    while len(steps) < 3:  # the long request is decoding
        time.sleep(0.0005)
    arrived_at_step.append(len(steps))
    short_updates: list[Update] = []
    server.loop.submit(Request("short", None, prompts[1], SamplingParams(max_new_tokens=2)), short_updates.append)
    while server.loop.num_in_flight:
        time.sleep(0.01)
    server.loop.on_step = None
    assert [t for u in short_updates for t in u.new_token_ids] == offline["p1"].output_token_ids[:2]
    finished_at = {request_id: index for index, (_, ids) in enumerate(steps) for request_id in ids}
    assert finished_at["short"] <= arrived_at_step[0] + 2  # its prefill, one decode step (one more: a race)
    assert steps[finished_at["short"]][0] == 2  # beside the long request
    assert finished_at["long"] == len(steps) - 1 > finished_at["short"]


def test_streamed_chunks_joined_equal_the_response_not_streamed(client, prompts):
    whole = complete(client, prompts[3], max_tokens=MAX_TOKENS)
    stream = complete(client, prompts[3], max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_streamed_equals_chat_not_streamed(client):
    messages = [{"role": "user", "content": "w5 w9 w17 w33"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage == whole.usage


def test_echo_with_logprobs_gives_the_offline_prompt_logprobs(client, prompts, offline):
    """lm-evaluation-harness's loglikelihood request: the prompt echoed with its tokens' logprobs."""
    prompt = prompts[2]
    choice = complete(client, prompt, max_tokens=1, logprobs=2, echo=True).choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
    expected = offline["p2"].prompt_logprobs
    assert logprobs.token_logprobs[1 : len(prompt)] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    for top, entry in zip(logprobs.top_logprobs[1 : len(prompt)], expected, strict=True):
        assert len(top) >= 2
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(entry.top_logprobs, abs=1e-5)
    assert choice.text.startswith(logprobs.tokens[0])


def test_n_choices_and_a_list_of_prompts_are_indexed_prompt_major(client, prompts, offline):
    response = complete(client, [prompts[0], prompts[4]], n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in response.choices] == [offline["p0"].output_token_ids] * 2 + [
        offline["p4"].output_token_ids
    ] * 2
    assert response.usage.prompt_tokens == len(prompts[0]) + len(prompts[4])


def test_a_stop_string_ends_the_text_before_it(client, prompts):
    whole = complete(client, prompts[3], extra_body={"ignore_eos": True}).choices[0]
    words = whole.text.split()
    assert len(words) > 3
    stopped = complete(client, prompts[3], stop=[words[2]], extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == whole.text[: whole.text.index(words[2])]


def test_models_lists_default_and_the_served_name_and_another_name_is_a_404(client, prompts):
    assert [model.id for model in client.models.list()] == ["default", "tiny"]
    with pytest.raises(openai.NotFoundError, match="default, tiny"):
        client.completions.create(model="gpt-4", prompt=prompts[0], max_tokens=1)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"temprature": 0}, "temprature"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": [5] * 300}, "prompt"),
    ],
)
def test_a_bad_field_gets_a_400_naming_it(server, body, field):
    response = httpx.post(server.base_url + "/completions", json={"prompt": [5, 6], "max_tokens": 2} | body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_malformed_json_gets_a_400(server):
    response = httpx.post(
        server.base_url + "/completions", content=b'{"prompt": [5,', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]


def test_a_request_whose_step_fails_fails_alone_and_the_server_goes_on(server, client, prompts, offline, monkeypatch):
    """A step that raises fails the requests it ran, with the reason; the next request is served."""
    runner = server.engine.runner

    class FailingOnOnePrompt:
        def execute(self, batch):
            if any(request.prompt_token_ids == prompts[2] for request in batch.requests):
                raise RuntimeError("a kernel refused this batch")
            return runner.execute(batch)

    monkeypatch.setattr(server.engine.core, "runner", FailingOnOnePrompt())
    with pytest.raises(openai.BadRequestError, match="a kernel refused this batch"):
        complete(client, prompts[2])
    assert complete(client, prompts[0]).choices[0].token_ids == offline["p0"].output_token_ids
    assert server.engine.core.scheduler.kv_cache_manager.block_pool.num_used_blocks == 0


def test_a_client_that_goes_away_has_its_request_aborted_and_the_pool_is_empty_after(server, prompts, monkeypatch):
    runner = server.engine.runner

    class SlowRunner:  # 20 ms a step, so that the requests are still running when their clients leave
        def execute(self, batch):
            time.sleep(0.02)
            return runner.execute(batch)

    monkeypatch.setattr(server.engine.core, "runner", SlowRunner())
    aborted_before = server.aborted_count()
    body = {"prompt": prompts[5], "max_tokens": 200, "ignore_eos": True, "stream": True}
    steps_before = server.loop.stats.num_steps
    with httpx.stream("POST", server.base_url + "/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and server.loop.stats.num_steps > steps_before + 2:
                break  # the client goes away mid-stream
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed one whose client times out
        httpx.post(server.base_url + "/completions", json=body | {"stream": False}, timeout=0.5)
    deadline = time.monotonic() + 20
    while server.loop.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.loop.num_in_flight == 0 and server.aborted_count() == aborted_before + 2
    assert server.metric("kv_cache_blocks_used") == 0 and server.metric("num_requests_running") == 0
    assert server.engine.core.scheduler.kv_cache_manager.block_pool.num_used_blocks == 0


def test_a_full_queue_answers_503_with_retry_after(tiny_llama_dir, prompts):
    with serving(tiny_llama_dir, max_waiting_requests=0, batch_size=1, max_new_tokens=MAX_TOKENS) as running:
        body = {"prompt": prompts[5], "max_tokens": 200, "ignore_eos": True}
        first = threading.Thread(
            target=httpx.post, args=(running.base_url + "/completions",), kwargs={"json": body, "timeout": 60}
        )
        first.start()
        while running.loop.num_in_flight == 0:
            time.sleep(0.01)
        response = httpx.post(running.base_url + "/completions", json=body)
        assert response.status_code == 503 and response.headers["Retry-After"] == "1"
        first.join()
        assert httpx.post(running.base_url + "/completions", json=body | {"max_tokens": 2}).status_code == 200


def test_metrics_count_tokens_and_latencies(server, client, prompts):
    before = server.metric("generation_tokens_total")
    complete(client, prompts[0], max_tokens=3, extra_body={"ignore_eos": True})
    assert server.metric("generation_tokens_total") == before + 3
    text = httpx.get(server.base_url.removesuffix("/v1") + "/metrics").text
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert f"infer_recipes:{name}_count" in text


def test_generate_and_stats_speak_cann_recipes_shapes(server, prompts, offline):
    base = server.base_url.removesuffix("/v1")
    body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    answer = httpx.post(base + "/generate", json=body).json()
    assert answer["output_ids"] == offline["p0"].output_token_ids
    assert answer["meta_info"]["prompt_tokens"] == len(prompts[0])
    bad = httpx.post(base + "/generate", json=body | {"sampling_params": {"max_new_tokenz": 3}})
    assert bad.status_code == 400 and "max_new_tokenz" in bad.json()["error"]["message"]
    assert httpx.get(base + "/stats").json()["kv_blocks_usable"] > 0


def test_sigterm_lets_the_running_request_finish_and_exits_0(tiny_llama_dir, tmp_path, prompts):
    config = {
        "model_config": {"model_path": str(tiny_llama_dir), "device": "cpu"},
        "data_config": {"apply_chat_template": False},
        "scheduler_config": {"block_size": 16, "max_new_tokens": 64},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    with server_process(path) as (base_url, process):
        body = {"prompt": prompts[5], "max_tokens": 150, "ignore_eos": True}
        results: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: results.append(httpx.post(base_url + "/completions", json=body, timeout=60))
        )
        sender.start()
        time.sleep(1.0)
        process.send_signal(signal.SIGTERM)
        sender.join()
        assert process.wait(60) == 0, printed(process)
    assert results[0].status_code == 200
    assert results[0].json()["choices"][0]["finish_reason"] == "length"
    assert json.loads(results[0].text)["usage"]["completion_tokens"] == 150
