"""Chat templates: turn a list of messages into the prompt text the model was tuned on.

CS336 notes "推理流程" starts from a prompt; for instruction-tuned models that prompt is built by the
Jinja2 template shipped with the tokenizer (GGUF ``tokenizer.chat_template``, HF
``tokenizer_config.json``). lmstack's one renderer, rendering as HF transformers'
``apply_chat_template`` does: a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
the ``loopcontrols`` extension, transformers' ``tojson``, a ``raise_exception`` helper and
``bos_token`` / ``eos_token`` in scope. ``Tokenizer.apply_chat_template`` is the usual entry point.
"""

from __future__ import annotations

import json
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The template is missing, malformed, or rejected the messages."""


def _raise(message: str):
    raise ChatTemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    try:
        return _env().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


@lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its context (``messages``, ``tools``, ...): a template renders
    ``tools=`` only if it reads ``tools`` (Jinja's ``meta.find_undeclared_variables``)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_env().parse(template)))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def render_chat_template(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = False,
    bos_token: str = "",
    eos_token: str = "",
    **extra,
) -> str:
    """Render ``template`` for ``messages`` ([{"role": ..., "content": ...}, ...])."""
    if not isinstance(template, str) or not template:
        raise ChatTemplateError(
            "this tokenizer has no chat template (chat_template is None); use plain prompts"
        )
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError(
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"messages[{i}]={m!r} must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatTemplateError(
                f"messages[{i}] has role={m['role']!r}; expected one of {ROLES}"
            )
    try:
        return _compile(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **extra,
        )
    except jinja2.TemplateError as e:  # e.g. an undefined variable used as a mapping
        raise ChatTemplateError(f"chat template failed: {e}") from None
