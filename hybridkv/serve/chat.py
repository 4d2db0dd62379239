"""Chat prompts: the tokenizer's own chat template when it has one (chat_template.jinja, as transformers saves it,
or tokenizer_config.json's `chat_template`), one given with `--chat-template`, else a plain one."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.serve.chat_protocol import ChatMessage
from hybridkv.serve.limits import RequestLimits, checked
from hybridkv.serve.protocol import APIError
from hybridkv.serve.tools import Tool, template_messages

if TYPE_CHECKING:
    from hybridkv.serve.async_engine import AsyncEngine


@cache
def _template(model_dir: str) -> tuple[str | None, dict]:
    path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    jinja = Path(model_dir) / "chat_template.jinja"
    template = jinja.read_text() if jinja.is_file() else cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    specials = {k: cfg.get(k) or "" for k in ("bos_token", "eos_token")}
    return (template if isinstance(template, str) else None), specials


def template_text(value: str) -> str:
    """`--chat-template`'s value: a file's text, or the value itself when it is an inline Jinja template."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor an inline Jinja template: give either")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


@dataclass(frozen=True)
class ChatRenderer:
    """Renders a chat to the text the model was trained on: `template` None means the plain fallback."""

    template: Any  # a compiled jinja2 Template, or None
    specials: dict

    @staticmethod
    def load(model_dir: str, override: str | None = None) -> ChatRenderer:
        """The model's template, or `override` (`template_text`); a template that does not parse is a ValueError
        here, at start-up, not at a client's request."""
        source, specials = _template(model_dir)
        source = template_text(override) if override is not None else source
        if source is None:
            return ChatRenderer(None, specials)
        try:
            import jinja2
        except ImportError as e:  # pragma: no cover - jinja2 ships with the serving extra
            raise ValueError("this model has a chat template but jinja2 is not installed: pip install jinja2") from e
        # As transformers renders: sandboxed, loop controls, its tojson (no HTML escaping), raise_exception and
        # strftime_now (templates call them), so the ids are Hugging Face's.
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return ChatRenderer(env.from_string(source), specials)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse (line {e.lineno}): {e.message}") from e

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """`tools`: the request's tool definitions, for templates that describe them to the model."""
        if self.template is None:
            return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=True, **self.specials)


@cache
def _model_renderer(model_dir: str) -> ChatRenderer:
    return ChatRenderer.load(model_dir)


def render_chat(model_dir: str, messages: list[dict[str, Any]]) -> str:
    """`messages` through the model folder's own template (or the plain one)."""
    return _model_renderer(model_dir).render(messages)


async def chat_text(
    limits: RequestLimits, chat: ChatRenderer, messages: list[ChatMessage], tools: list[Tool] | None = None
) -> str:
    """The chat rendered through the model's template, off the event loop; a chat whose messages alone are
    longer than any prompt that fits is refused before it renders."""
    dumped = template_messages([m.model_dump() for m in messages])
    sizes = [m.get("content") or "" for m in dumped] + [json.dumps(m.get("tool_calls", "")) for m in dumped]
    checked(limits.check_chat, sizes[: len(dumped)], param="messages")
    checked(limits.check_chat, ["".join(sizes)], param="messages")
    described = None if not tools else [t.model_dump(exclude_none=True) for t in tools]
    try:
        return await asyncio.to_thread(chat.render, dumped, described)
    except Exception as e:  # a template raises on chats it does not take (roles out of turn, a tool role, ...)
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from e


async def chat_ids(
    engine: AsyncEngine,
    limits: RequestLimits,
    chat: ChatRenderer,
    messages: list[ChatMessage],
    tools: list[Tool] | None = None,
) -> list[int]:
    """The chat's token ids as transformers' `apply_chat_template(tokenize=True)` gives them: the template spells
    every special token it wants (a BOS among them), so its text is tokenized without adding any."""
    text = await chat_text(limits, chat, messages, tools)
    try:
        return await asyncio.to_thread(engine.engine.tokenize, text, False)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
