"""Tool calls for ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

OpenAI's function calling (the chat API reference: ``tools``, ``tool_choice``, the ``tool_calls`` message
and its streamed ``delta.tool_calls``). Three ways to answer, by ``tool_choice``:

- ``"required"`` or a named function: the output is *constrained* to a call by the grammar path
  ``response_format`` uses (``structured.py``, llguidance). For a named function the model writes the
  arguments object itself (its schema is the function's ``parameters``); for ``"required"`` it writes
  ``{"name": <const>, "arguments": <that tool's parameters>}`` (an ``anyOf`` over the tools), or with
  ``parallel_tool_calls`` (OpenAI's default: true) a JSON array of one or more of them. The arguments always
  validate against the schema (unless ``max_tokens`` cuts them: finish_reason "length").
- ``"auto"`` (the default when tools are given): only for a chat template that renders ``tools`` and
  documents a call format this module parses — Hermes/Qwen's ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``. The tools are rendered into the prompt by the template; the model decides, and the
  output is parsed: if every ``<tool_call>`` block holds a JSON call of a given tool, they become
  ``tool_calls`` (the text before the first block, if any, stays ``content``); otherwise the whole output is
  ``content``. Any other template is a 400 naming ``tool_choice`` — never text pretending to comply.
- ``"none"``: plain generation; the tools are not rendered into the prompt.

In the constrained modes the tools are rendered into the prompt too when the template reads ``tools``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from lmstack.serve.server import APIError
from lmstack.tokenizer.chat import template_variables

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # the Hermes / Qwen2.5 call format
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_HEAD = re.compile(
    r'\{"name":"([a-zA-Z0-9_-]*)","arguments":'
)  # a constrained call's start (compact)


@dataclass
class ToolPlan:
    """What a request's tools ask for: ``mode`` "auto" | "required" | "named"; ``schema`` constrains the
    output (required, named); ``render`` puts ``tools`` into the prompt."""

    mode: str
    tools: list[dict]
    render: bool
    parallel: bool
    name: str | None = None
    schema: dict | None = None
    names: set[str] = field(default_factory=set)


def _parameters(fn) -> dict:
    """A function's arguments schema: a JSON schema of an object (absent = no arguments)."""
    p = fn.parameters
    if p is None:
        return NO_ARGUMENTS
    if not isinstance(p, dict) or p.get("type", "object") != "object":
        raise APIError(
            400,
            f"tools: function {fn.name!r} has parameters={json.dumps(p)[:80]}; expected a JSON schema "
            'of an object ({"type": "object", "properties": {...}})',
            param="tools",
        )
    return p


def _rebase(schema, root: str):
    """``schema`` with its local references (``"#"``, ``"#/$defs/x"``) made relative to ``root`` (a JSON
    pointer to where the schema is placed inside a larger one)."""
    if isinstance(schema, list):
        return [_rebase(x, root) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = root + v[1:]
        else:
            out[k] = _rebase(v, root)
    return out


def plan(body, template: str | None) -> ToolPlan | None:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> the plan, or None for plain text."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools (none were given)", param="tool_choice")
        if body.parallel_tool_calls:
            raise APIError(
                400,
                "parallel_tool_calls needs tools (none were given)",
                param="parallel_tool_calls",
            )
        return None
    names: dict[str, dict] = {}
    for i, tool in enumerate(body.tools):
        fn = tool.function
        if not NAME.match(fn.name):
            raise APIError(
                400,
                f"tools[{i}].function.name={fn.name!r}: expected 1 to 64 of a-z, A-Z, 0-9, _ and -",
                param="tools",
            )
        if fn.name in names:
            raise APIError(
                400, f"tools[{i}]: the function name {fn.name!r} is given twice", param="tools"
            )
        names[fn.name] = _parameters(fn)
    if choice == "none":
        return None
    try:
        reads_tools = bool(template) and "tools" in template_variables(template)
    except ValueError as e:  # ChatTemplateError: the template does not parse
        raise APIError(400, f"messages: {e}", param="messages") from None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == "auto":
        if not reads_tools:
            raise APIError(
                400,
                'tool_choice "auto" needs a chat template that renders tools; this model\'s does not '
                '(use tool_choice "required" or a named function: the output is then constrained to '
                "a call)",
                param="tool_choice",
            )
        if OPEN not in template:
            raise APIError(
                400,
                'tool_choice "auto": this model\'s chat template renders tools but has no tool-call '
                f"format lmstack can parse (only Hermes/Qwen's {OPEN}...{CLOSE}); use "
                'tool_choice "required" or a named function',
                param="tool_choice",
            )
        return ToolPlan("auto", tools, True, parallel, names=set(names))
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/{n}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n in names
        ]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": one, "minItems": 1} if parallel else dict(one)
        # each tool's schema under the root's $defs, its own "#..." references re-rooted there
        schema["$defs"] = {n: _rebase(p, f"#/$defs/{n}") for n, p in names.items()}
        return ToolPlan("required", tools, reads_tools, parallel, schema=schema, names=set(names))
    name = choice.function.name
    if name not in names:
        raise APIError(
            400,
            f"tool_choice names the function {name!r}, which is not in tools ({sorted(names)})",
            param="tool_choice",
        )
    return ToolPlan("named", tools, reads_tools, False, name, names[name], set(names))


def template_messages(messages, template: str | None) -> list[dict]:
    """The chat messages as the template reads them; an assistant turn's ``tool_calls`` (arguments parsed into
    an object, as HF templates expect) and a tool turn's ``tool_call_id`` only for a template that renders
    them (else a 400 naming the message)."""
    out = []
    source = template or ""
    for i, m in enumerate(messages):
        d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "tool":
            if not re.search(r"""["']tool["']""", source):
                raise APIError(
                    400,
                    f"messages[{i}]: this model's chat template does not render role 'tool' messages",
                    param="messages",
                )
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls: only assistant messages call tools",
                    param="messages",
                )
            if "tool_calls" not in source:
                raise APIError(
                    400,
                    f"messages[{i}].tool_calls: this model's chat template does not render tool calls",
                    param="messages",
                )
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    args = None
                if not isinstance(args, dict):
                    raise APIError(
                        400,
                        f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                        param="messages",
                    )
                calls.append(
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": args},
                    }
                )
            d["tool_calls"] = calls
        out.append(d)
    return out


def _object_end(text: str, start: int) -> int | None:
    """The index just past the JSON object starting at ``text[start]`` ("{"), or None if it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for k in range(start, len(text)):
        ch = text[k]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _constrained_calls(plan: ToolPlan, text: str) -> list[tuple[str, str]]:
    """(name, arguments so far) of the calls in a constrained output (a valid compact JSON prefix)."""
    if plan.mode == "named":
        return [(plan.name, text)]
    calls, i = [], 1 if plan.parallel else 0  # past the array's "["
    while m := _HEAD.match(text, i):  # a call's name is known once its header is complete
        start = m.end()
        end = _object_end(text, start)
        calls.append((m[1], text[start:end]))
        if end is None:
            break
        i = end + 1  # past the call object's "}"
        if text[i : i + 1] == ",":
            i += 1
    return calls


def _auto_calls(plan: ToolPlan, rest: str) -> list[tuple[str, str]] | None:
    """The calls in the output from its first ``<tool_call>`` on, or None unless all of it is well-formed
    calls of given tools (then the output is plain content)."""
    calls, i = [], 0
    while True:
        i = len(rest) - len(rest[i:].lstrip())
        if i == len(rest):
            return calls or None
        if not rest.startswith(OPEN, i) or (j := rest.find(CLOSE, i)) < 0:
            return None
        try:
            call = json.loads(rest[i + len(OPEN) : j])
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in plan.names:
            return None
        args = call.get("arguments", {})
        if not isinstance(args, dict):
            return None
        calls.append((call["name"], json.dumps(args, ensure_ascii=False)))
        i = j + len(CLOSE)


def _held_back(text: str) -> int:
    """How many trailing characters of streamed content could still start a ``<tool_call>`` (or are
    whitespace before one)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k + len(text[:-k]) - len(text[:-k].rstrip())
    return len(text) - len(text.rstrip())


class ToolOutput:
    """One choice's output as OpenAI's ``content`` + ``tool_calls``: whole (``message``) or as stream deltas
    (``deltas``, fed the cumulative text). Both read the same parse, so the streamed deltas add up to the
    non-streamed message; call ids are made once per call."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.ids = plan, []
        self.sent_content, self.sent_args = 0, []  # what the stream has sent

    def parse(self, text: str, finished: bool) -> tuple[str, list[tuple[str, str]] | None]:
        """(content so far, calls so far or None = plain content)."""
        if self.plan.mode != "auto":
            return "", _constrained_calls(self.plan, text)
        k = text.find(OPEN)
        if k < 0:
            return (text if finished else text[: len(text) - _held_back(text)]), None
        if not finished:
            return text[:k].rstrip(), []
        calls = _auto_calls(self.plan, text[k:])
        return (text, None) if calls is None else (text[:k].rstrip(), calls)

    def _id(self, i: int) -> str:
        while len(self.ids) <= i:
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self.ids[i]

    def message(self, text: str) -> dict:
        content, calls = self.parse(text, True)
        if calls is None:
            return {"role": "assistant", "content": content, "refusal": None}
        calls_json = [
            {"id": self._id(i), "type": "function", "function": {"name": n, "arguments": a or ""}}
            for i, (n, a) in enumerate(calls)
        ]
        msg = {"role": "assistant", "content": content or None, "refusal": None}
        return {**msg, "tool_calls": calls_json}

    def deltas(self, text: str, finished: bool) -> list[dict]:
        """The ``delta`` objects that bring the stream up to ``text``."""
        content, calls = self.parse(text, finished)
        out = []
        if len(content) > self.sent_content:
            out.append({"content": content[self.sent_content :]})
            self.sent_content = len(content)
        for i, (name, args) in enumerate(calls or ()):
            args = args or ""
            if i == len(self.sent_args):  # a new call: its id, type and name first
                head = {"name": name, "arguments": ""}
                call = {"index": i, "id": self._id(i), "type": "function", "function": head}
                out.append({"tool_calls": [call]})
                self.sent_args.append(0)
            if len(args) > self.sent_args[i]:
                frag = {"arguments": args[self.sent_args[i] :]}
                out.append({"tool_calls": [{"index": i, "function": frag}]})
                self.sent_args[i] = len(args)
        return out

    def called(self, text: str) -> bool:
        """Whether the finished output is complete calls (a constrained one cut by a ``stop`` string is not)."""
        if self.plan.mode == "auto":
            return bool(self.parse(text, True)[1])
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return False
        return True
