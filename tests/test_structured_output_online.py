"""Structured output and bad words through the server on the real default model: OpenAI's
response_format (json_schema, json_object), vLLM's guided_choice and bad_words as extra fields, and
a schema that does not compile answered with a 400 carrying the compiler's message."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.online_harness import serving
from tests.test_structured_output import COLOURS

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Give a colour and some shades as JSON."}]


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with serving(smollm2_dir, batch_size=4, max_new_tokens=64) as running:
        yield running


def chat(server, **body) -> httpx.Response:
    payload = {"model": "default", "messages": QUESTION, "temperature": 0} | body
    return httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=300)


def content(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_response_format_json_schema_is_followed(server):
    response_format = {"type": "json_schema", "json_schema": {"name": "colours", "schema": COLOURS}}
    jsonschema.validate(json.loads(content(chat(server, response_format=response_format))), COLOURS)


def test_response_format_json_object_gives_an_object(server):
    cat = [{"role": "user", "content": "Reply with a JSON object with the keys name and colour of a cat."}]
    assert isinstance(json.loads(content(chat(server, messages=cat, response_format={"type": "json_object"}))), dict)


def test_guided_choice_and_bad_words_as_vllm_takes_them(server):
    """A banned word's token sequences never appear; the grammar may still spell the word with other
    tokens (as in vLLM, bad words ban token sequences, not text)."""
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    assert content(chat(server, messages=capital, guided_choice=["Paris", "Rome"])) == "Paris"
    response = chat(
        server, messages=capital, guided_choice=["Paris", "Rome"], bad_words=["Paris"], return_token_ids=True
    )
    assert content(response) in ("Paris", "Rome")
    token_ids = response.json()["choices"][0]["token_ids"]
    tokenizer = server.engine.tokenizer
    for banned in (
        tokenizer.encode("Paris", add_special_tokens=False),
        tokenizer.encode(" Paris", add_special_tokens=False),
    ):
        assert not any(token_ids[i : i + len(banned)] == banned for i in range(len(token_ids))), token_ids


def test_a_schema_that_does_not_compile_is_a_400_with_the_compilers_message(server):
    response = chat(server, guided_regex="(ab|")
    assert response.status_code == 400
    error = response.json()["error"]
    assert "regex does not compile: Regex parsing error" in error["message"]
    assert error["param"] == "structured_outputs"
    unknown = chat(server, response_format={"type": "xml"})
    assert unknown.status_code == 400 and "response_format" in unknown.json()["error"]["message"]
