"""Tool calls on ``/v1/chat/completions`` (``serve/tools.py``), through the official ``openai`` client.

``tool_choice`` "required" / a named function: the random tiny model's output is constrained to a call, so
its arguments validate against the tool's schema (``jsonschema``, an independent validator), streamed or not.
``tool_choice`` "auto": a ChatML-like template with a tools section and Hermes' ``<tool_call>`` format; the
prompt is checked against transformers' own rendering of the same template with ``tools=``, and the
"model" is scripted (a logits processor that forces the text the user message asks for), so the parse of
a written call into ``tool_calls`` is seen. Every bad tool field is a 400 naming it."""

import json

import httpx
import pytest
from serve_helpers import MODEL, live_server, tiny_engine, tiny_model

from lmstack.serve import Server

openai = pytest.importorskip("openai", reason="the official client")
jsonschema = pytest.importorskip("jsonschema", reason="validates the tool-call arguments")
pytest.importorskip("llguidance", reason="the grammar library behind constrained tool calls")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "description": "now", "parameters": CLOCK},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
USER = [{"role": "user", "content": "weather in Rome?"}]
WEATHER_CHOICE = {"type": "function", "function": {"name": "get_weather"}}

# ChatML with a tools section and Hermes' call format (as Qwen2.5's template has), tool turns as tool
# responses, assistant calls written back as <tool_call> blocks
HERMES = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% for c in m.tool_calls %}"
    "{{ '<tool_call>\n' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson)"
    " + '\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|im_start|>", "<|im_end|>")


class Force:
    """A scripted "model": at step k every logit but ``ids[k]``'s is -inf (then EOS)."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __call__(self, output_ids, logits):
        out = logits.clone().fill_(-float("inf"))
        out[self.ids[min(len(output_ids), len(self.ids) - 1)]] = 0.0
        return out


class ScriptedServer(Server):
    """Writes the last user message's text (after "say:"), then EOS, whatever the model would."""

    def sampling(self, body, max_tokens, logprobs, index, processors=()):
        script = body.messages[-1].text().split("say:", 1)[1]
        force = Force([*self.tokenizer.encode(script), self.tokenizer.eos_token_id])
        return super().sampling(body, max_tokens, logprobs, index, [*processors, force])


def long_engine():
    """The tiny model with room for a prompt holding the tools (a byte-level tokenizer: ~700 tokens)."""
    return tiny_engine(tiny_model(max_seq_len=2048))


@pytest.fixture(scope="module")
def served():
    """The plain ChatML template: no tools section (only constrained calls are possible)."""
    with live_server(Server(tiny_engine(), MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def hermes():
    engine = long_engine()
    engine.tokenizer.chat_template = HERMES
    with live_server(Server(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def scripted():
    engine = long_engine()
    engine.tokenizer.chat_template = HERMES
    with live_server(ScriptedServer(engine, MODEL)) as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused")


def post(url, **body):
    return httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=60)


def sse(r) -> list:
    """The SSE events of a streamed answer: JSON objects, then the string "[DONE]"."""
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def check_call_message(choice: dict) -> list[dict]:
    """OpenAI's shape of a tool-call answer; returns the calls."""
    assert choice["finish_reason"] == "tool_calls", choice
    msg = choice["message"]
    assert set(msg) == {"role", "content", "refusal", "tool_calls"}, msg
    assert msg["role"] == "assistant" and msg["content"] is None
    for call in msg["tool_calls"]:
        assert set(call) == {"id", "type", "function"} and call["type"] == "function"
        assert call["id"].startswith("call_") and set(call["function"]) == {"name", "arguments"}
        assert isinstance(call["function"]["arguments"], str)  # a JSON string, not an object
    assert len({c["id"] for c in msg["tool_calls"]}) == len(msg["tool_calls"])
    return msg["tool_calls"]


def hf_render(template, messages, tools=None) -> str:
    """transformers' own ``apply_chat_template(..., tools=)`` over the same template (the reference)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        chat_template=template,
    )
    return tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )


def n_tokens(text: str) -> int:
    """The tiny byte-level tokenizer's count, by hand: one per byte, one per ChatML special."""
    return len(text.encode()) - sum(text.count(s) * (len(s.encode()) - 1) for s in SPECIALS)


# ---- constrained: a named function, "required" -------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_named_function_is_called_with_arguments_that_validate(served, seed):
    r = post(
        served,
        messages=USER,
        tools=TOOLS,
        tool_choice=WEATHER_CHOICE,
        seed=seed,
        temperature=1.0,
        max_tokens=80,
    )
    assert r.status_code == 200, r.text
    (call,) = check_call_message(r.json()["choices"][0])
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_without_the_constraint_the_model_writes_no_call(served):
    """The same sampler, no tools: the random model's text is not a valid arguments object (what the
    constraint is for)."""
    r = post(served, messages=USER, seed=0, temperature=1.0, max_tokens=80)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), WEATHER)


def test_required_calls_one_or_more_tools_with_valid_arguments(served):
    names = set()
    for seed in (1, 2, 3):  # seeds whose calls close within max_tokens
        r = post(
            served,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            temperature=1.0,
            max_tokens=120,
        )
        calls = check_call_message(r.json()["choices"][0])
        assert calls
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
            names.add(name)
    assert names == {"get_weather", "get_time"}  # the model chose between them


def test_required_without_parallel_tool_calls_is_exactly_one_call(served):
    for seed in range(6):
        r = post(
            served,
            messages=USER,
            tools=TOOLS,
            tool_choice="required",
            seed=seed,
            parallel_tool_calls=False,
            temperature=1.0,
            max_tokens=80,
        )
        (call,) = check_call_message(r.json()["choices"][0])
        jsonschema.validate(
            json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
        )


def test_a_function_without_parameters_is_called_with_no_arguments(served):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    r = post(
        served,
        messages=USER,
        tools=tools,
        tool_choice="required",
        seed=0,
        max_tokens=40,
        parallel_tool_calls=False,
    )
    (call,) = check_call_message(r.json()["choices"][0])
    assert call["function"] == {"name": "ping", "arguments": "{}"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_local_refs_in_a_tools_schema_resolve(served, choice):
    """A ``$ref`` into the tool's own ``$defs`` (pydantic writes those): "required" nests the schema inside
    the call schema, so its references must be re-rooted (they were a 400: "Pointer does not exist")."""
    params = {
        "type": "object",
        "$defs": {"colour": {"enum": ["red", "blue"]}},
        "properties": {"c": {"$ref": "#/$defs/colour"}},
        "required": ["c"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    r = post(
        served,
        messages=USER,
        tools=tools,
        tool_choice=choice,
        seed=2,
        max_tokens=60,
        parallel_tool_calls=False,
    )
    assert r.status_code == 200, r.text
    (call,) = check_call_message(r.json()["choices"][0])
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)


@pytest.mark.parametrize("choice", ["required", WEATHER_CHOICE])
def test_streamed_calls_accumulate_to_the_non_streamed_answer(served, choice):
    kw = dict(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice=choice,
        seed=1,
        temperature=1.0,
        max_tokens=120,
    )
    full = client(served).chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "tool_calls"
    want = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    # the openai client's own accumulation of the stream
    with client(served).chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got = final.choices[0]
    assert got.finish_reason == "tool_calls" and not got.message.content
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == want
    assert all(c.id.startswith("call_") and c.type == "function" for c in got.message.tool_calls)
    # the raw events: per call index, id/type/name first, then only argument fragments; finish last
    events = sse(post(served, **{k: v for k, v in kw.items() if k != "model"}, stream=True))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1]]
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    seen: dict[int, dict] = {}
    for c in chunks[1:-1]:
        (tc,) = c["choices"][0]["delta"]["tool_calls"]
        i = tc["index"]
        if i not in seen:
            assert i == len(seen) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == ""
            seen[i] = {"name": tc["function"]["name"], "arguments": ""}
        else:
            assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            seen[i]["arguments"] += tc["function"]["arguments"]
    assert [(s["name"], s["arguments"]) for s in seen.values()] == want
    assert max(
        len(c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"])
        for c in chunks[1:-1]
    ) < len(want[0][1])  # fragments, not one piece


def test_a_call_cut_by_max_tokens_is_finish_length(served):
    r = post(served, messages=USER, tools=TOOLS, tool_choice=WEATHER_CHOICE, seed=0, max_tokens=5)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    args = choice["message"]["tool_calls"][0]["function"]["arguments"]
    assert len(args) == 5 and '{"city":"'.startswith(args[:5])  # a prefix of the arguments JSON


def test_a_call_cut_by_a_stop_string_is_not_finish_tool_calls(served):
    kw = dict(messages=USER, tools=TOOLS, tool_choice=WEATHER_CHOICE, seed=0, max_tokens=80)
    whole = post(served, **kw).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    cut = post(served, **kw, stop=[","]).json()["choices"][0]  # the arguments' first comma
    assert cut["finish_reason"] == "stop"
    args = cut["message"]["tool_calls"][0]["function"]["arguments"]
    assert whole["message"]["tool_calls"][0]["function"]["arguments"].startswith(args + ",")


# ---- auto: the template renders tools and has Hermes' call format ----------------------------


def test_auto_renders_the_tools_as_transformers_does_and_none_does_not(hermes):
    full = post(hermes, messages=USER, tools=TOOLS, seed=0, max_tokens=4, temperature=0)
    assert full.status_code == 200, full.text
    want = n_tokens(hf_render(HERMES, USER, tools=TOOLS))
    assert full.json()["usage"]["prompt_tokens"] == want
    none = post(hermes, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert none.json()["usage"]["prompt_tokens"] == n_tokens(hf_render(HERMES, USER))
    assert none.json()["usage"]["prompt_tokens"] < want
    # the random model writes no call: plain content, the engine's finish reason
    choice = none.json()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]


def test_tool_turns_and_earlier_calls_are_rendered_as_transformers_does(hermes):
    args = {"city": "Rome", "days": 2, "metric": True}
    ours = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    theirs = [  # transformers' format: the arguments as an object
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": args}}
            ],
        },
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    r = post(hermes, messages=ours, tools=TOOLS, max_tokens=2)
    assert r.status_code == 200, r.text
    text = hf_render(HERMES, theirs, tools=TOOLS)
    assert "<tool_response>" in text and '"days": 2' in text
    assert r.json()["usage"]["prompt_tokens"] == n_tokens(text)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2, "metric": false}}\n</tool_call>'  # noqa: E501
CLOCK_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'


@pytest.mark.parametrize(
    "script, content, calls",
    [
        (CALL, None, [("get_weather", {"city": "Rome", "days": 2, "metric": False})]),
        (
            "Let me check.\n" + CALL + "\n" + CLOCK_CALL,
            "Let me check.",
            [
                ("get_weather", {"city": "Rome", "days": 2, "metric": False}),
                ("get_time", {"tz": "CET"}),
            ],
        ),
    ],
)
def test_auto_parses_a_written_call_into_tool_calls(scripted, script, content, calls):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "say:" + script}], tools=TOOLS)
    r = client(scripted).chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == calls
    with client(scripted).chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert (final.message.content or None) == content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]


@pytest.mark.parametrize(
    "script",
    [
        "just text, no call",
        "a <tool without its end",
        '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # not a given tool
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": \n</tool_call>',  # not JSON
        CALL[:-4],  # not closed
    ],
)
def test_auto_output_that_is_not_a_well_formed_call_is_content(scripted, script):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "say:" + script}], tools=TOOLS)
    r = client(scripted).chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == script
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client(scripted).chat.completions.create(**kw, stream=True)
        if c.choices
    )
    assert streamed == script


# ---- 400s ----------------------------------------------------------------------------------


def fn(name="f", parameters=None, type_="function"):
    f = {"name": name}
    if parameters is not None:
        f["parameters"] = parameters
    return {"type": type_, "function": f}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [fn(type_="retrieval")]}, "tools"),
        ({"tools": [fn("a"), fn("a")], "tool_choice": "required"}, "tools"),
        ({"tools": [fn("has space")], "tool_choice": "required"}, "tools"),
        ({"tools": [fn("x" * 65)], "tool_choice": "required"}, "tools"),
        ({"tools": [fn("")], "tool_choice": "required"}, "tools"),
        ({"tools": [fn(parameters="x")], "tool_choice": "required"}, "tools"),
        ({"tools": [fn(parameters={"type": "string"})], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [
                    fn(parameters={"type": "object", "properties": {"a": {"type": "nonsense"}}})
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": [fn("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "tool_choice",
        ),
        ({"tools": [fn("f")], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [fn("f")]}, "tool_choice"),  # auto, and this template renders no tools
        ({"tools": [fn("f")], "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tool_choice": WEATHER_CHOICE}, "tool_choice"),
        ({"parallel_tool_calls": True}, "parallel_tool_calls"),
        (
            {
                "tools": [fn("f")],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "messages"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    }
                ]
            },
            "messages",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(served, extra, param):
    r = post(served, **{"messages": USER, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize(
    "messages",
    [
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                ],
            }
        ],
        [
            {
                "role": "user",
                "content": "x",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            }
        ],
    ],
)
def test_bad_tool_messages_are_400s_even_where_the_template_renders_them(hermes, messages):
    r = post(hermes, messages=messages, max_tokens=4)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_auto_with_a_template_that_renders_tools_in_another_format_is_a_400():
    engine = long_engine()
    engine.tokenizer.chat_template = HERMES.replace("<tool_call>", "[CALL]").replace(
        "</tool_call>", "[/CALL]"
    )
    with live_server(Server(engine, MODEL)) as url:
        r = post(url, messages=USER, tools=TOOLS, max_tokens=4)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tool_choice" and "format" in err["message"]
        ok = post(
            url, messages=USER, tools=TOOLS, tool_choice=WEATHER_CHOICE, max_tokens=80, seed=0
        )
        assert ok.status_code == 200, ok.text  # a constrained call needs no call format
        check_call_message(ok.json()["choices"][0])


def test_a_template_that_does_not_parse_is_a_400_with_tools():
    engine = tiny_engine()
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m.content }"
    with live_server(Server(engine, MODEL)) as url:
        r = post(url, messages=USER, tools=TOOLS, max_tokens=4)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_tools_on_the_completions_endpoint_are_400s(served):
    for field, value in (("tools", [fn()]), ("tool_choice", "required")):
        r = httpx.post(
            served + "/v1/completions", json={"model": MODEL, "prompt": "hi", field: value}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
