"""Chat prompts: the tokenizer's own chat template when it has one (chat_template.jinja, as transformers saves it,
or tokenizer_config.json's `chat_template`), else a plain one."""

from __future__ import annotations

import asyncio
import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from hybridkv.serve.limits import RequestLimits, checked
from hybridkv.serve.protocol import APIError, ChatMessage

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


def render_chat(model_dir: str, messages: list[dict[str, str]]) -> str:
    template, specials = _template(model_dir)
    if template is None:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    try:
        import jinja2
    except ImportError as e:  # pragma: no cover - jinja2 ships with the serving extra
        raise APIError(500, "this model has a chat template but jinja2 is not installed", "server_error") from e
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **specials)


async def chat_text(engine: AsyncEngine, limits: RequestLimits, messages: list[ChatMessage]) -> str:
    """The chat rendered through the model's template, off the event loop; a chat whose messages alone are
    longer than any prompt that fits is refused before it renders."""
    dumped = [m.model_dump() for m in messages]
    checked(limits.check_chat, [m["content"] for m in dumped], param="messages")
    return await asyncio.to_thread(render_chat, engine.engine.config.model, dumped)


async def chat_ids(engine: AsyncEngine, limits: RequestLimits, messages: list[ChatMessage]) -> list[int]:
    """The chat's token ids as transformers' `apply_chat_template(tokenize=True)` gives them: the template spells
    every special token it wants (a BOS among them), so its text is tokenized without adding any."""
    text = await chat_text(engine, limits, messages)
    try:
        return await asyncio.to_thread(engine.engine.tokenize, text, False)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from e
