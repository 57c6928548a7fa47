"""The Responses API (`POST /v1/responses`) against a real gateway over the test swarm, through the `openai` SDK's
`client.responses` and an OpenAI Agents SDK agent: greedy text equal to local transformers' for the same
conversation, plain and streamed (raw replies and events validated against OpenAI's schemas,
tests/fixtures/openai_responses_schemas.py); `previous_response_id` served from the session pool (cached input tokens);
`text.format` json_schema output that parses and validates; stored responses read and deleted; a 400 from the SDK.
Short generations, one module-scoped gateway (tests/fixtures/gateway_fixtures.py). The in-process cases:
tests/gateway/test_responses_unit.py."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator

from tests.fixtures import openai_responses_schemas as ors
from tests.fixtures.gateway_fixtures import client, gateway, one_torch_thread, reference_text  # noqa: F401
from tests.fixtures.openai_checks import check, check_event

INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
TOKENS = 16  # OpenAI's least max_output_tokens


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def test_greedy_text_equals_transformers_plain_and_streamed(client, model_name, tokenizer, reference_model):
    """Plain (the raw reply validated) and streamed through the SDK (as a message list with input_text parts); both
    equal local transformers' greedy text, as the chat endpoint's does (tests/gateway/test_gateway.py)."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    expected = reference_text(tokenizer, reference_model, messages, TOKENS)
    args = dict(model=model_name, instructions=INSTRUCTIONS, max_output_tokens=TOKENS, temperature=0, store=False)
    raw = client.responses.with_raw_response.create(input=QUESTION, **args)
    check(ors.RESPONSE, raw.http_response.json())
    response = raw.parse()
    assert response.output_text == expected and response.status in ("completed", "incomplete")
    assert response.usage.output_tokens <= TOKENS and response.usage.output_tokens_details.reasoning_tokens == 0
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    events = list(client.responses.create(input=items, stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{response.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_previous_response_id_reuses_the_pooled_session(gateway, client, model_name, tokenizer, reference_model):
    """A second turn naming the first: its input comes after the first turn's input and output, the session pool
    serves that prefix (cached input tokens), and its greedy text is transformers' for the whole conversation. The
    second turn is streamed raw, each event validated against its schema."""
    hello = "My name is Ada. Say hello to me."
    first = client.responses.create(model=model_name, input=hello, max_output_tokens=TOKENS, temperature=0)
    with httpx.stream("POST", gateway.base_url + "/responses", timeout=180,
                      headers={"Authorization": "Bearer unused"}, json={  # the SDK client's key: the same owner
            "model": model_name, "input": "What is my name?", "previous_response_id": first.id, "stream": True,
            "max_output_tokens": TOKENS, "temperature": 0}) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    for event in events:
        check_event(event)
    second = events[-1]["response"]
    assert second["previous_response_id"] == first.id
    usage = second["usage"]
    assert usage["input_tokens"] > first.usage.input_tokens + first.usage.output_tokens
    assert usage["input_tokens_details"]["cached_tokens"] >= first.usage.input_tokens  # at least the first prompt
    messages = [{"role": "user", "content": hello}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    text = "".join(part["text"] for item in second["output"] for part in item.get("content", []))
    assert text == reference_text(tokenizer, reference_model, messages, TOKENS)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.responses.create(model=model_name, input="Hi", previous_response_id=first.id)


def test_json_schema_output_parses_and_validates(client, model_name):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    response = client.responses.create(
        model=model_name, input="Invent a person and answer in JSON.", max_output_tokens=48, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}})
    assert response.status == "completed"
    Draft202012Validator(schema).validate(json.loads(response.output_text))


def test_unknown_and_unsupported_parameters_are_400s(client, model_name):
    with pytest.raises(openai.BadRequestError, match="Unknown parameter: 'frobnicate'"):
        client.responses.create(model=model_name, input="Hi", extra_body={"frobnicate": 1})
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model=model_name, input="Hi", tools=[{"type": "web_search"}])


def _weather_agent(gateway, model_name, calls):
    """An OpenAI Agents SDK agent on the gateway's Responses API (OpenAIResponsesModel) with one function tool; its
    first turn is forced to call the tool (tool_choice required: the tiny model would not call it by itself)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export (no internet here)

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    model = OpenAIResponsesModel(model=model_name, openai_client=openai.AsyncOpenAI(
        base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=180))
    return Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                 model=model, model_settings=ModelSettings(tool_choice="required", max_tokens=48, temperature=0))


def test_an_agents_sdk_agent_calls_a_function_tool(gateway, model_name):
    """The tool runs, its output goes back as a function_call_output item (the SDK resets tool_choice after a call),
    and the run ends with text."""
    from agents import Runner

    calls: list = []
    result = Runner.run_sync(_weather_agent(gateway, model_name, calls), "What is the weather in Paris?", max_turns=4)
    assert calls and isinstance(calls[0], str) and calls[0]
    first = result.raw_responses[0].output
    assert [item.type for item in first] == ["function_call"] and first[0].name == "get_weather"
    assert isinstance(result.final_output, str) and result.final_output


def test_an_agents_sdk_agent_streams(gateway, model_name):
    """The same agent run streamed (`Runner.run_streamed`: the SDK reads the typed events): the tool's call and
    output are items of the run, text deltas arrive, and the final output is their text."""
    import asyncio

    from agents import Runner

    calls: list = []

    async def run():
        result = Runner.run_streamed(_weather_agent(gateway, model_name, calls), "Weather in Rome?", max_turns=4)
        deltas, items = [], []
        async for event in result.stream_events():
            if event.type == "raw_response_event" and event.data.type == "response.output_text.delta":
                deltas.append(event.data.delta)
            elif event.type == "run_item_stream_event":
                items.append(event.item.type)
        return result, deltas, items

    result, deltas, items = asyncio.run(run())
    assert calls and items[:2] == ["tool_call_item", "tool_call_output_item"]
    assert result.final_output and "".join(deltas).endswith(result.final_output)
