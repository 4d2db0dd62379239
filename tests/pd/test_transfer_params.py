"""kv_transfer_params as hostile input: the one typed schema, its limits, and the signature over every field."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from hybridkv.connectors.mesh_auth import MeshKeys
from hybridkv.connectors.pd.params import ParamLimits, parse_transfer_params
from hybridkv.connectors.pd.protocol import parse_handshake_reply, parse_lease_reply, parse_request
from hybridkv.connectors.pd.transfer_params import PREFILL_KEYS, RemoteDecode, RemotePrefill, prompt_hash

LIMITS = ParamLimits(num_groups=2, max_blocks=33, max_tokens=512)
KEYS = MeshKeys.derive(b"a mesh secret of enough bytes")


def issued(**changes) -> RemotePrefill:
    params = RemotePrefill(
        engine_id="0123456789abcdef0123456789abcdef",
        host="127.0.0.1",
        port=5600,
        request_id="cmpl-7",
        lease_id="f" * 32,
        block_ids=((1, 2, 3), (0, 4, 5)),
        num_tokens=40,
        prompt_hash=prompt_hash(list(range(40))),
        expires_at=int(time.time()) + 30,
    )
    return replace(params, **changes).signed(KEYS.params)


def test_issued_params_round_trip_and_verify():
    params = issued()
    assert set(params.to_json()) == PREFILL_KEYS - {"remote_state_pages"}  # only a recurrent-state model's
    again = parse_transfer_params(params.to_json(), LIMITS)
    assert again == params and again.signature_ok(KEYS.params) and not again.expired()
    assert not again.signature_ok(MeshKeys.derive(b"another secret, 16+ bytes").params)


@pytest.mark.parametrize(
    "change",
    [
        {"engine_id": "another-engine"},
        {"host": "127.0.0.2"},
        {"port": 5601},
        {"lease_id": "e" * 32},
        {"block_ids": ((1, 2, 3), (0, 4, 6))},  # another request's block
        {"num_tokens": 41},
        {"prompt_hash": prompt_hash([1, 2, 3])},
        {"expires_at": 2**39},
    ],
)
def test_changing_any_field_breaks_the_signature(change):
    params = issued()
    forged = replace(params, **change)  # keeps the old signature
    assert not parse_transfer_params(forged.to_json(), LIMITS).signature_ok(KEYS.params)


def test_expiry_allows_a_little_clock_skew_only():
    assert not issued(expires_at=int(time.time()) - 2).expired()
    assert issued(expires_at=int(time.time()) - 60).expired()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("remote_port", 9223372036854775808, "remote_port: must be an integer in \\[1, 65535\\]"),
        ("remote_port", 0, "remote_port"),
        ("remote_port", True, "remote_port"),
        ("remote_port", "5600", "remote_port"),
        ("remote_block_ids", [[10**30], [1]], "remote_block_ids\\[0\\]: ids must be integers"),
        ("remote_block_ids", [["a"], [1]], "remote_block_ids\\[0\\]"),
        ("remote_block_ids", [[1e300], [1]], "remote_block_ids\\[0\\]"),
        ("remote_block_ids", [[True], [1]], "remote_block_ids\\[0\\]"),
        ("remote_block_ids", [[-1], [1]], "remote_block_ids\\[0\\]"),
        ("remote_block_ids", [[1]], "must be 2 lists, one per KV group"),
        ("remote_block_ids", [[[[1]]], [1]], "remote_block_ids\\[0\\]"),
        ("remote_block_ids", [list(range(34)), [1]], "at most 33 ids"),
        ("remote_block_ids", "1,2,3", "must be 2 lists"),
        ("remote_num_tokens", 10**6, "remote_num_tokens"),
        ("remote_host", "evil host", "remote_host: malformed"),
        ("remote_host", "a" * 300, "remote_host"),
        ("remote_engine_id", "../../etc", "remote_engine_id: malformed"),
        ("lease_id", "1", "lease_id: malformed"),
        ("signature", None, "signature: malformed"),
        ("expires_at", 1.5, "expires_at"),
        ("surprise", 1, "surprise: unknown field"),
    ],
)
def test_every_bad_field_is_a_value_error_naming_it(field, value, message):
    raw = issued().to_json() | {field: value}
    with pytest.raises(ValueError, match=message):
        parse_transfer_params(raw, LIMITS)


def test_missing_fields_and_non_objects_are_named():
    raw = issued().to_json()
    del raw["prompt_hash"]
    with pytest.raises(ValueError, match="prompt_hash: missing"):
        parse_transfer_params(raw, LIMITS)
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_transfer_params([1, 2], LIMITS)


def test_prefill_requests_take_vllms_unset_fields_only():
    vllm_proxy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    assert parse_transfer_params(vllm_proxy, LIMITS) == RemoteDecode()
    assert parse_transfer_params({"do_remote_decode": True}, LIMITS) == RemoteDecode()
    with pytest.raises(ValueError, match="remote_host: must be unset"):
        parse_transfer_params({"do_remote_decode": True, "remote_host": "10.0.0.1"}, LIMITS)
    with pytest.raises(ValueError, match="not a field of a prefill request"):
        parse_transfer_params({"do_remote_decode": True, "lease_id": "x"}, LIMITS)
    assert parse_transfer_params({}, LIMITS) is None
    assert parse_transfer_params({"do_remote_decode": False, "do_remote_prefill": False}, LIMITS) is None
    with pytest.raises(ValueError, match="do_remote_decode: must be true or false"):
        parse_transfer_params({"do_remote_decode": "yes"}, LIMITS)
    with pytest.raises(ValueError, match="need do_remote_prefill: true"):
        parse_transfer_params({"remote_host": "127.0.0.1"}, LIMITS)


@pytest.mark.parametrize(
    "reply",
    [
        {"ok": True},
        {"ok": True, "engine_id": "e", "agent_metadata": "!!", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed"},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 2**40,
         "layout": "packed"},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"x": [1, 2]}, "num_blocks": 9,
         "layout": "packed"},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, -2]}, "num_blocks": 9,
         "layout": "packed"},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed", "extra": 1},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed", "state_regions": {"0": 1}},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed", "state_regions": [[0, 1, 2]]},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed", "state_regions": [[0, -1, 2, 2]]},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed", "state_regions": [[0, 1, 2, True]]},
        {"ok": True, "engine_id": "e", "agent_metadata": "", "placement": {"0": [1, 2]}, "num_blocks": 9,
         "layout": "packed", "state_regions": [[0, 1, 2, 2]] * 5000},
    ],
)  # fmt: skip
def test_hostile_handshake_replies_are_value_errors(reply):
    with pytest.raises(ValueError):
        parse_handshake_reply(reply)


def test_side_channel_messages_parse_strictly():
    assert parse_handshake_reply({"ok": False, "error": "x" * 10_000}).error == "x" * 200 + "..."  # peer_text
    assert parse_lease_reply({"ok": True, "held": True}).held
    for bad in ({"ok": True, "held": 1}, {"ok": True}):
        with pytest.raises(ValueError):
            parse_lease_reply(bad)
    for bad in ({"op": "steal"}, {"op": "renew", "lease_id": "1", "signature": "a" * 64},
                {"op": "handshake", "compat": "a" * 64}):  # fmt: skip
        with pytest.raises(ValueError):
            parse_request(bad)


def test_hex_fields_take_no_trailing_newline_or_whitespace():
    """`$` would match before a final newline and bytes.fromhex skips spaces: a signature must be exactly 64
    lowercase hex digits, or one params set would have many accepted spellings."""
    params = issued().to_json()
    for field in ("signature", "lease_id", "prompt_hash"):
        for suffix in ("\n", " ", "\t"):
            with pytest.raises(ValueError, match=f"{field}: malformed"):
                parse_transfer_params(params | {field: params[field] + suffix}, LIMITS)
    with pytest.raises(ValueError, match="signature: malformed"):
        parse_transfer_params(params | {"signature": params["signature"].upper()}, LIMITS)


STATE_LIMITS = ParamLimits(num_groups=2, max_blocks=33, max_tokens=512, state_pages=4)


def test_state_pages_travel_as_runs_and_are_signed():
    params = issued(block_ids=((1, 2, 3), (0, 9, 20)), state_pages=((9, 10, 11, 12), (20, 21, 40, 41)))
    wire = params.to_json()
    assert wire["remote_state_pages"] == [[[9, 4]], [[20, 2], [40, 2]]]  # ranges, not one id per page
    again = parse_transfer_params(wire, STATE_LIMITS)
    assert again == params and again.signature_ok(KEYS.params)
    forged = parse_transfer_params(wire | {"remote_state_pages": [[[9, 4]], [[20, 2], [50, 2]]]}, STATE_LIMITS)
    assert not forged.signature_ok(KEYS.params)  # pointing a page elsewhere breaks the signature


@pytest.mark.parametrize(
    "pages",
    [
        [[[9, 3]]],  # too few pages for this instance's state entry
        [[[9, 5]]],  # too many
        [[[9, 2], [10, 2]]],  # a page twice
        [[[0, 4]]],  # the null block
        [[[2**31 - 2, 4]]],  # past the id range
        [[[9, -1], [9, 5]]],  # a negative count
        [[[9, True], [10, 3]]],  # a bool is no count
        [[9, 10, 11, 12]],  # ids, not runs
        [],  # no entry at all
        "9-12",
        [[[9.0, 4]]],
    ],
)
def test_bad_state_pages_are_refused_by_name(pages):
    wire = issued(block_ids=((1, 2, 3), (0, 9, 0))).to_json() | {"remote_state_pages": pages}
    with pytest.raises(ValueError, match="remote_state_pages"):
        parse_transfer_params(wire, STATE_LIMITS)


def test_state_pages_sent_to_an_instance_without_state_are_refused():
    wire = issued().to_json() | {"remote_state_pages": [[[9, 4]]]}
    with pytest.raises(ValueError, match="remote_state_pages"):
        parse_transfer_params(wire, LIMITS)
