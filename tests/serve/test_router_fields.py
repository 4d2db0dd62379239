"""Fields routers add to every request (vllm-router forwards SGLang's and vLLM's extras) are ignored quietly at
the values that change nothing; other unknown fields, or a router field at a value we would not honour, are
warned about (the request still runs, as in vLLM)."""

from __future__ import annotations

import logging

import pytest

from hybridkv.serve.chat_protocol import ChatRequest
from hybridkv.serve.protocol import CompletionRequest, parse

BASE = {"prompt": "hi", "max_tokens": 2}
ROUTER_EXTRAS = {"no_stop_trim": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "continue_final_message": False, "include_reasoning": True}  # fmt: skip


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_router_extras_at_their_no_op_values_are_debug_only(caplog):
    with caplog.at_level(logging.DEBUG, logger="hybridkv.serve.protocol"):
        parse(CompletionRequest, BASE | ROUTER_EXTRAS)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        parse(ChatRequest, chat | ROUTER_EXTRAS)
    assert warnings(caplog) == []
    assert any("router fields ignored" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "extra", [{"continue_final_message": True}, {"skip_special_tokens": False}, {"my_field": 1}], ids=str
)
def test_unknown_fields_or_router_fields_that_would_change_the_output_are_warned(caplog, extra):
    with caplog.at_level(logging.DEBUG, logger="hybridkv.serve.protocol"):
        parse(CompletionRequest, BASE | ROUTER_EXTRAS | extra)
    (message,) = warnings(caplog)
    assert message == f"request fields ignored (not supported): {next(iter(extra))}"
