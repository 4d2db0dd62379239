"""The stop rules and the text, one request at a time, with a tokenizer whose tokens are letters (a token's text
is one character, two for ids >= 100), so where a stop string falls across tokens is exact."""

from __future__ import annotations

from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request, RequestStatus

EOS = 0


class Letters:
    """id i < 100 -> chr(ord('a') + i % 26); ids >= 100 -> two letters."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) if i < 100 else chr(97 + i % 26) * 2 for i in ids if i != EOS)


def run(tokens: list[int], max_model_len: int = 1000, **params) -> tuple[Request, RequestStatus | None, list[str]]:
    """Feed `tokens` until a rule stops the request; returns it, its status and the visible text after each."""
    req = Request("r", [1, 2], SamplingParams(**{"max_tokens": 100, **params}), 16, (EOS,))
    detok = IncrementalDetokenizer(Letters(), req, max_model_len)  # type: ignore[arg-type]
    seen, status = [], None
    for t in tokens:
        req.append_token(t)
        status = detok.append(t)
        seen.append(detok.visible_text())
        if status is not None:
            break
    return req, status, seen


def test_a_stop_string_across_tokens_ends_the_text_before_it():
    req, status, seen = run([0 + 7, 4, 11, 11, 14, 22], stop=("llo",))  # h e l l o w
    assert status is RequestStatus.FINISHED_STOPPED and req.stop_reason == "llo"
    assert len(req.output_token_ids) == 5 and seen[-1] == "he"


def test_a_stop_string_inside_one_two_letter_token_is_found():
    _, status, seen = run([1, 111, 3], stop=("hh",))  # b, "hh" (111 % 26 = 7), d
    assert status is RequestStatus.FINISHED_STOPPED and seen[-1] == "b"


def test_the_end_a_stop_string_may_still_claim_is_held_back():
    _, status, seen = run([1, 2, 3, 4], stop=("cx", "zzz"))
    assert status is None
    assert seen == ["", "", "b", "bc"]  # the last len("zzz") - 1 characters wait: the next tokens may complete it


def test_stop_strings_wait_for_min_tokens_then_see_the_whole_text():
    req, status, _ = run([1, 2, 3, 4], stop=("bc",), min_tokens=3)
    assert status is RequestStatus.FINISHED_STOPPED and len(req.output_token_ids) == 3


def test_a_stop_token_is_left_out_and_waits_for_min_tokens():
    req, status, seen = run([1, EOS, 2, EOS], min_tokens=3)
    assert status is RequestStatus.FINISHED_STOPPED and req.stop_reason == EOS
    assert req.output_token_ids == [1, EOS, 2, EOS] and seen[-1] == "bc"
    req, status, seen = run([1, 5, 2], stop_token_ids=(5,))
    assert req.stop_reason == 5 and seen[-1] == "b"
    _, status, _ = run([1, EOS, 2], ignore_eos=True, max_tokens=3)
    assert status is RequestStatus.FINISHED_LENGTH


def test_length_stops_at_max_tokens_and_at_max_model_len_before_stop_strings():
    req, status, seen = run([1, 2, 3], max_tokens=2, stop=("bc",))
    assert status is RequestStatus.FINISHED_LENGTH and req.stop_reason is None and seen[-1] == "bc"
    req, status, _ = run([1] * 10, max_model_len=5)
    assert status is RequestStatus.FINISHED_LENGTH and req.num_tokens == 5
