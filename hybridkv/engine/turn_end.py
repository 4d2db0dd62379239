"""Turn-end checkpoints (`state_checkpoints="turn_end"`): a chat's next turn resumes after this turn's answer.

A finished request's answer was computed one token at a time, and a prompt computes the same tokens in whole
split units: their states differ in bits, so decode-path states are never published (`chunking`). Instead, once
a request finishes, the engine queues a *background* request whose prompt is the whole conversation so far,
prompt + answer (T tokens). Like any prompt it resumes from the cached prompt-end checkpoint and computes
[A * floor((P - 1) / A), T) in whole units, publishing every block and state up to A * floor((T - 1) / A):
exactly what the next turn's prefill would compute there, moved to when the engine is idle.

    turn 1   | prompt (P)                  | answer |
    publish  | hit to A*floor((P-1)/A) ... | computed in units -> checkpoint at A*floor((T-1)/A)
    turn 2   | prompt + answer + user      -> resumes at A*floor((T-1)/A)

The background request runs only while nothing else waits or runs, is dropped rather than preempted, counts in
no statistic and is returned to nobody (`Scheduler.add_background`). Only for turns that add at least one split
unit past the prompt's last checkpoint.
"""

from __future__ import annotations

from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request, RequestStatus

ENDED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
PUBLISH = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def turn_end_request(req: Request, align: int, max_model_len: int) -> Request | None:
    """The background request that publishes `req`'s conversation up to its answer's last whole unit, or None
    when there is nothing new to publish (the answer ends inside the prompt's last unit, the request did not end
    normally, or the conversation is as long as the model allows)."""
    if req.status not in ENDED or req.background:
        return None
    tokens = req.all_token_ids
    before = (req.num_prompt_tokens - 1) // align * align
    after = (len(tokens) - 1) // align * align
    if after <= before or len(tokens) >= max_model_len:
        return None
    return Request(f"{req.request_id}#turn-end", tokens, PUBLISH, req.block_size, cache_salt=req.cache_salt)
