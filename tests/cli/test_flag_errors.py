"""Flags refused with a message that says what to change: `--tool-call-parser` (hybridkv/cli/vllm_flags.py) and
`--kv-cache-metrics-sample` (EngineConfig). Both were untested error paths."""

from __future__ import annotations

import pytest

from hybridkv.cli.vllm_flags import tool_parser
from hybridkv.engine.config import EngineConfig
from hybridkv.serve.tools import TOOL_PARSERS


def test_an_unknown_tool_call_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="--tool-call-parser must be one of") as e:
        tool_parser(True, "no-such-parser")
    assert all(name in str(e.value) for name in TOOL_PARSERS) and "'no-such-parser'" in str(e.value)


def test_auto_tool_choice_needs_a_parser_and_a_parser_alone_turns_nothing_on():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        tool_parser(True, None)
    name = next(iter(TOOL_PARSERS))
    assert tool_parser(True, name) == name
    assert tool_parser(False, name) is None  # vLLM: "auto" stays refused per request without the switch
    assert tool_parser(False, None) is None


@pytest.mark.parametrize("share", [0, -0.5, 1.01, 2])
def test_a_metrics_sample_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(ValueError, match=r"kv_cache_metrics_sample must be in \(0, 1\]"):
        EngineConfig(kv_cache_metrics=True, kv_cache_metrics_sample=share)


@pytest.mark.parametrize("share", [1e-6, 0.5, 1])
def test_a_share_inside_is_kept(share):
    assert EngineConfig(kv_cache_metrics=True, kv_cache_metrics_sample=share).kv_cache_metrics_sample == share
