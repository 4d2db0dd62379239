"""parse_json without a server: a lone surrogate is refused wherever it hides and however it is spelled (the
strings are walked only when the raw body could hold one), a paired one is a character, depth is always checked."""

from __future__ import annotations

import pytest

from hybridkv.serve.guards import MAX_JSON_DEPTH, parse_json
from hybridkv.serve.protocol import APIError

LONE = [
    b'{"prompt": "a\\ud800b"}',  # an escape, in a value
    b'{"a\\uDFFF": 1}',  # upper-case hex, in a key
    b'{"p": [[["x", "\\udbff"]]]}',  # deep in lists
    '{"p": "\ud83d\ude00"}'.encode("utf-8", "surrogatepass"),  # raw bytes of a pair: two lone surrogates
]


@pytest.mark.parametrize("raw", LONE, ids=["value", "key", "nested", "raw-bytes"])
def test_a_lone_surrogate_is_refused(raw):
    with pytest.raises(APIError, match="lone surrogate"):
        parse_json(raw)


def test_a_paired_escape_is_one_character_and_a_plain_body_parses():
    assert parse_json(b'{"p": "\\ud83d\\ude00"}') == {"p": "\U0001f600"}
    assert parse_json('{"p": ["é", "\\u00e9"]}'.encode()) == {"p": ["é", "é"]}


def test_depth_is_checked_with_or_without_the_string_walk():
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    for raw in (deep, b'{"x": "\\ud83d\\ude00", "y": ' + deep + b"}"):
        with pytest.raises(APIError, match="nests deeper"):
            parse_json(raw)
    parse_json(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH)
