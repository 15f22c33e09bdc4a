"""Chat templates rendered the way transformers' ``apply_chat_template`` renders them.

A model's chat template is Jinja source shipped with its tokenizer. transformers compiles it in an
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that does not HTML-escape, and the globals ``raise_exception`` and
``strftime_now``; the variables are ``messages``, ``tools``, ``documents``,
``add_generation_prompt`` and the tokenizer's special tokens as strings (``bos_token``,
``eos_token``, ...). We do the same, so a template renders to the same text here and there
(tests/unit/test_hf_tokenizer.py compares with transformers). The sandbox matters: a template comes
from a downloaded model directory and must not reach Python objects (DESIGN.md rule 8).

The ``{% generation %}`` block (assistant-token masks) is accepted and rendered as plain text; we
do not track its indices.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Optional, Sequence

__all__ = ["render_chat_template", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template raised (``raise_exception``) or does not compile; the message says which."""


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks indices)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template does not compile (line {err.lineno}: {err.message}); "
                                "fix chat_template in tokenizer_config.json or chat_template.jinja") from None


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
                         " (a verl row's `prompt` column is such a list)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] = {m!r} is not a chat message: each needs 'role' and 'content'")


def render_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = False,
                         special_tokens: Optional[dict] = None, tools=None, documents=None, **kwargs) -> str:
    """The text of `messages` under `template`. `special_tokens` (``{"bos_token": "<s>", ...}``) and
    `kwargs` become template variables; kwargs win, as in transformers."""
    import jinja2

    _check_messages(messages)
    compiled = _compile(template)
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compiled.render(messages=[dict(m) for m in messages], tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
