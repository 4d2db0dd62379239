"""Turn-end checkpoints (`state_checkpoints="turn_end"`): a chat's next turn resumes after this turn's answer.

A finished request's answer was computed one token at a time, and a prompt computes the same tokens in whole
split units: their states differ in bits, so decode-path states are never published (`chunking`). Instead, once
a request finishes with T = prompt + answer tokens, the engine queues a *background* request whose prompt is the
conversation's first E = A * floor(T / A) tokens and one filler token (the token a prompt's last position
computes alone; its KV is never published). Like any prompt it resumes from the cached prompt-end checkpoint and
computes [A * floor((P - 1) / A), E) in whole units, publishing every block and the state at E: exactly what the
next turn's prefill computes there, moved to when the engine is idle.

    turn 1   | prompt (P)                   | answer      |
    publish  | hit to A*floor((P-1)/A) .. E | + filler       -> checkpoint at E = A*floor(T/A)
    turn 2   | prompt + answer + user          -> resumes at E

The background request runs only while nothing else waits or runs, yields (is dropped) as soon as a user's
request waits, counts in no statistic and is returned to nobody (`Scheduler.add_background`). Only for turns
whose E lies past the prompt's last checkpoint.
"""

from __future__ import annotations

from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request, RequestStatus

ENDED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
PUBLISH = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def turn_end_request(req: Request, align: int, max_model_len: int) -> Request | None:
    """The background request that publishes `req`'s conversation up to E = align * floor(T / align), or None
    when there is nothing new to publish (E is not past the prompt's last checkpoint) or the request did not end
    normally."""
    if req.status not in ENDED or req.background:
        return None
    tokens = req.all_token_ids
    before = (req.num_prompt_tokens - 1) // align * align
    end = len(tokens) // align * align
    if end <= before or end + 1 > max_model_len:
        return None
    filler = tokens[0]  # any id of the vocabulary: only its logits are computed, and thrown away
    return Request(
        f"{req.request_id}#turn-end",
        [*tokens[:end], filler],
        PUBLISH,
        req.block_size,
        cache_salt=req.cache_salt,
        hasher=req.hasher,
    )
