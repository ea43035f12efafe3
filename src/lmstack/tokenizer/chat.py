"""Chat templates: render a list of messages with the Jinja2 template a model ships (GGUF
``tokenizer.chat_template``), the way HF transformers does (sandboxed, trimmed blocks)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = False, **extra) -> str:
    """``messages`` like ``[{"role": "user", "content": "Hi"}]`` -> the prompt text."""
    if not isinstance(template, str) or not template:
        raise ValueError("this tokenizer has no chat template (chat_template is None)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message #{i} is {m!r}; expected a dict with 'role' and 'content'")
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
