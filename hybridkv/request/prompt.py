"""The one statement of what a prompt must be, checked where a request enters (the engine, the server, the
scheduler), so a bad prompt fails before it holds anything."""

from __future__ import annotations

from collections.abc import Sequence


def check_prompt(token_ids: Sequence[int], max_model_len: int, vocab_size: int | None = None) -> list[int]:
    """`token_ids` as a list when they make a prompt: not empty, short enough that at least one generated token
    fits within `max_model_len`, and (given `vocab_size`) every id an integer in [0, vocab_size). Otherwise a
    ValueError that says what to change."""
    ids = list(token_ids)
    if not ids:
        raise ValueError("the prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
            "(the prompt and at least one generated token must fit): shorten it or raise max_model_len"
        )
    if vocab_size is not None and any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size})")
    return ids
