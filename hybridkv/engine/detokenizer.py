"""IncrementalDetokenizer: one request's output text and every rule that stops it, in one place.

After each sampled token, `append` says whether the request is done, in this order:
1. a stop token: an EOS id (unless `ignore_eos`) or one of `stop_token_ids`, once `min_tokens` are out; its text is
   not part of the output (as vLLM);
2. length: `max_tokens` generated, or the request reached `max_model_len`;
3. a stop string of `stop`, once `min_tokens` are out; the output ends before it.

Text is decoded incrementally: only the new tokens and `DECODE_OVERLAP` before them (for their context: leading
spaces, multi-byte characters), so a token costs O(1), not O(length). Text once produced never changes: an
incomplete UTF-8 sequence at the end waits for its next bytes. `visible_text` holds back the end of the text that
may be the start of a stop string the next tokens complete, since text once sent cannot be taken back.
"""

from __future__ import annotations

from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.request.state import Request, RequestStatus

DECODE_OVERLAP = 6  # tokens decoded again before the new ones, for their context


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, req: Request, max_model_len: int) -> None:
        self.tokenizer, self.req, self.max_model_len = tokenizer, req, max_model_len
        params = req.params
        self.stop_token_ids = frozenset(req.eos_token_ids) | frozenset(params.stop_token_ids)
        self.hold = max(map(len, params.stop), default=1) - 1  # characters a stop string may still claim
        self.text = ""  # the decoded text of output tokens [0, decoded), complete characters only
        self.decoded = 0
        self.checked = 0  # characters of `text` before this one hold no stop string
        self.final: str | None = None  # set once the request finished normally

    def append(self, token_id: int) -> RequestStatus | None:
        """`token_id` was just appended to the request's output: the status it finishes with, if it does."""
        req, params = self.req, self.req.params
        n_out = len(req.output_token_ids)
        if n_out >= params.min_tokens and token_id in self.stop_token_ids:
            req.stop_reason = token_id
            return self.finish(RequestStatus.FINISHED_STOPPED)
        if n_out >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return self.finish(RequestStatus.FINISHED_LENGTH)
        if not params.stop or self.tokenizer is None:
            return None
        pending = self._decode()
        if n_out < params.min_tokens:
            return None
        # A stop string first completes in the text not yet searched, or overlaps its start by < len(stop) chars.
        current = self.text + pending
        start = max(0, self.checked - self.hold)
        hit = next((s for s in params.stop if s in current[start:]), None)
        self.checked = len(self.text)
        if hit is None:
            return None
        req.stop_reason = hit
        return self.finish(RequestStatus.FINISHED_STOPPED)

    def _decode(self) -> str:
        """Decode the output tokens not decoded yet; returns the text after `self.text` that an incomplete
        UTF-8 sequence at the end keeps from being committed (empty when everything was committed)."""
        ids = self.req.output_token_ids
        if self.tokenizer is None or self.decoded == len(ids):
            return ""
        start = max(0, self.decoded - DECODE_OVERLAP)
        before = self.tokenizer.decode(ids[start : self.decoded])
        after = self.tokenizer.decode(ids[start:])
        if after.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            return after[len(before) :]
        self.text, self.decoded = self.text + after[len(before) :], len(ids)
        return ""

    def finish(self, status: RequestStatus) -> RequestStatus:
        """The request ends here with `status` (by a rule above, or its structured-output constraint completed):
        its text is final."""
        self.final = self.full_text()
        return status

    def full_text(self) -> str:
        """The whole output as text, decoded in one piece: a stop token's text left out, a stop string cut."""
        req = self.req
        if self.tokenizer is None:
            return ""
        ids = req.output_token_ids
        if isinstance(req.stop_reason, int):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        if isinstance(req.stop_reason, str):
            text = text[: text.find(req.stop_reason)]
        return text

    def visible_text(self) -> str:
        """The text that may be shown now: all of it once the request finished; before that, all but the end a
        stop string may still claim."""
        if self.final is not None:
            return self.final
        self._decode()
        return self.text[: max(0, len(self.text) - self.hold)]
