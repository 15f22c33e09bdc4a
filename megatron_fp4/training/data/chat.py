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

The template's work is bounded, so a hostile one cannot hang or exhaust memory: every loop
iteration and every call counts against `MAX_STEPS`; ``*``, ``+``, ``**``, ``~`` and the value a
call returns may not build a string, list or number larger than `MAX_TEXT` characters (items,
bits), and the rendered text is cut off at `MAX_TEXT`. Any failure inside the template
(``raise_exception``, ``1/0``, a sandbox refusal, a limit) is one `ChatTemplateError`.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from datetime import datetime
from functools import lru_cache
from typing import Optional, Sequence

__all__ = ["render_chat_template", "ChatTemplateError", "MAX_STEPS", "MAX_TEXT"]

MAX_STEPS = 1_000_000   # loop iterations + calls per rendering (a long real conversation takes ~1e5)
MAX_TEXT = 32 * 2**20   # characters of any string / items of any list / bits of any int the template builds,
#                         and of all values its calls return together
_RESERVED = "__mfp4_"   # names of the hooks the compiled template calls; a template may not use them


class ChatTemplateError(ValueError):
    """The template does not compile, raised (``raise_exception``), failed (``1/0``, a sandbox refusal)
    or exceeded a limit on its work; the message says which."""


class _LimitExceeded(Exception):
    pass


def _size(value) -> int:
    """Characters / items / bits of `value` (0 for what cannot grow)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length()
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_count(count: int, what: str) -> None:
    if count > MAX_TEXT:
        raise _LimitExceeded(f"{what} would exceed {MAX_TEXT} characters/items/bits")


_PADDING = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "indent"})
_FORMATS = frozenset({"format", "format_map"})


def _check_args(name: str, values) -> None:
    """Refuse, before it runs, a call of a padding or formatting function (``'x'.ljust(n)``,
    ``s|center(n)``, ``s|indent(n)``, ``'{:>n}'.format(x)``, ``'%nd'|format(x)``) asking for more
    than MAX_TEXT characters."""
    for value in values:
        if name in _PADDING and isinstance(value, int) and not isinstance(value, bool):
            _check_count(value, f"{name}()'s argument")
        elif name in _FORMATS and isinstance(value, str):
            _check_format(value)


def _check_format(text: str) -> None:
    if any(len(digits) > 8 and int(digits) > MAX_TEXT for digits in re.findall(r"\d+", text)):
        raise _LimitExceeded(f"a format string asks for a width of more than {MAX_TEXT} characters")


def _bounded_binop(op: str, left, right):
    """``*``, ``+``, ``**``, ``%`` refused before they would build more than MAX_TEXT (then computed as usual)."""
    if op == "%":
        if isinstance(left, str):
            _check_format(left)
        return left % right
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _check_count(len(seq) * n, "'*'")
        if isinstance(left, int) and isinstance(right, int):
            _check_count(left.bit_length() + right.bit_length(), "'*'")
        return left * right
    if op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _check_count(len(left) + len(right), "'+'")
        return left + right
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _check_count(min(right, MAX_TEXT + 1) * (abs(left).bit_length() - 1 or 1), "'**'")
    return left ** right


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (transformers tracks indices)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class _Bounded(ImmutableSandboxedEnvironment):
        """The sandbox with a work budget (per thread, reset by `start`) and size-checked operators."""

        intercepted_binops = frozenset(["*", "+", "**", "%"])

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self._local = threading.local()

        def start(self) -> None:
            self._local.steps = self._local.built = 0

        def step(self) -> None:
            self._local.steps += 1
            if self._local.steps > MAX_STEPS:
                raise _LimitExceeded(f"more than {MAX_STEPS} loop iterations and calls")

        def bounded(self, name: str, fn, args, kwargs, checked=()):
            """``fn(*args, **kwargs)`` counted as a step, with the arguments of `name` (the function
            the template calls) and the result checked."""
            self.step()
            _check_args(name, [*args, *kwargs.values(), *checked])
            result = fn(*args, **kwargs)
            self._local.built += _size(result)
            _check_count(self._local.built, "the values its calls return")
            return result

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            # str methods come bound, str.format wrapped by the sandbox (functools.update_wrapper)
            owner = getattr(__obj, "__self__", getattr(getattr(__obj, "__wrapped__", None), "__self__", None))
            return __self.bounded(getattr(__obj, "__name__", ""), super().call, (__context, __obj, *args), kwargs,
                                  checked=(owner,) if isinstance(owner, str) else ())

        def call_binop(self, context, op, left, right):
            return _bounded_binop(op, left, right)

    class _Hooks(NodeTransformer):
        """Every ``for`` iterates through the step counter; every ``~`` is size-checked."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Call(nodes.Name(_RESERVED + "iter", "load"), [node.iter], [], None, None)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Call(nodes.Name(_RESERVED + "concat", "load"), node.nodes, [], None, None)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = _Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])

    def counted(iterable):
        for item in iterable:
            env.step()
            yield item

    def concat(*parts):
        parts = [str(p) for p in parts]
        _check_count(sum(map(len, parts)), "'~'")
        return "".join(parts)

    env.filters["tojson"] = tojson

    def bounded_filter(name, fn):
        @functools.wraps(fn)  # keeps jinja's pass_context/pass_environment marks
        def wrapper(*args, **kwargs):
            return env.bounded(name, fn, args, kwargs)
        return wrapper

    env.filters = {name: bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals[_RESERVED + "iter"], env.globals[_RESERVED + "concat"] = counted, concat
    try:
        tree = env.parse(template)
        if any(n.name.startswith(_RESERVED) for n in tree.find_all(nodes.Name)):
            raise ChatTemplateError(f"the chat template uses a name starting with {_RESERVED!r}, which is "
                                    "reserved; rename it in chat_template")
        return env, env.from_string(_Hooks().visit(tree))
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
        if not isinstance(m["content"], (str, list, tuple, type(None))):
            raise ValueError(f"messages[{i}]['content'] is a {type(m['content']).__name__} ({m['content']!r}); a "
                             "message's content must be text (a string) or a list of content parts")


def render_chat_template(template: str, messages: Sequence[dict], add_generation_prompt: bool = False,
                         special_tokens: Optional[dict] = None, tools=None, documents=None, **kwargs) -> str:
    """The text of `messages` under `template`. `special_tokens` (``{"bos_token": "<s>", ...}``) and
    `kwargs` become template variables; kwargs win, as in transformers."""
    import jinja2

    _check_messages(messages)
    env, compiled = _compile(template)
    variables = {**(special_tokens or {}), **kwargs}
    env.start()
    out, size = [], 0
    try:
        for chunk in compiled.generate(messages=[dict(m) for m in messages], tools=tools, documents=documents,
                                       add_generation_prompt=add_generation_prompt, **variables):
            size += len(chunk)
            if size > MAX_TEXT:
                raise _LimitExceeded(f"renders more than {MAX_TEXT} characters")
            out.append(chunk)
    except _LimitExceeded as err:
        raise ChatTemplateError(f"the chat template exceeds a limit on its work ({err}); a chat template must "
                                "render the messages in bounded time and size") from None
    except jinja2.exceptions.TemplateError as err:
        raise ChatTemplateError(f"the chat template refused the messages: {err}") from None
    except (Exception, RecursionError) as err:  # noqa: BLE001 - untrusted template code: any error is its own
        raise ChatTemplateError(f"the chat template failed on the messages: {type(err).__name__}: {err}") from None
    return "".join(out)
