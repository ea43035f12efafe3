"""Chat templates: turn a list of messages into the prompt text the model was tuned on.

Seed 001 "推理流程" starts from a prompt; for instruction-tuned models that prompt is built
by the Jinja2 template shipped in the model's files (GGUF ``tokenizer.chat_template``, HF
``tokenizer_config.json``). It is rendered the way HF transformers does: a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``raise_exception`` helper and ``bos_token`` / ``eos_token`` in scope.
"""

from __future__ import annotations

import json
from functools import lru_cache

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplateError(ValueError):
    """The template is missing, malformed, or rejected the messages."""


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from None


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         bos_token: str = "", eos_token: str = "", **extra) -> str:
    """Render ``template`` for ``messages`` ([{"role": ..., "content": ...}, ...])."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"messages[{i}]={m!r} must be a dict with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}] has role={m['role']!r}; expected one of {ROLES}")
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos_token, eos_token=eos_token, **extra)


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        template: str | None = None) -> str:
    """Render the tokenizer's own chat template (or ``template``) for ``messages``."""
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError("this tokenizer has no chat template; pass template=... or use plain prompts")

    def token_text(tid):
        return tokenizer.decode([tid]) if tid is not None else ""

    return render_chat_template(template, messages, add_generation_prompt,
                                bos_token=token_text(getattr(tokenizer, "bos_token_id", None)),
                                eos_token=token_text(getattr(tokenizer, "eos_token_id", None)))
