"""LLM: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.request.outputs import CompletionOutput, RequestOutput
from hybridkv.request.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: a Hugging Face model folder; None runs the embedded default model."""
        self.engine = LLMEngine(EngineConfig(model=model or str(DEFAULT_MODEL_DIR), **kwargs))

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling params")
        reqs = []
        try:  # all or nothing: a bad prompt, or a step that fails, leaves no request behind
            for p, sp in zip(prompts, per_prompt):
                reqs.append(self.engine.add_request(p, sp))
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [
            RequestOutput(
                r.request_id,
                p if isinstance(p, str) else None,
                r.prompt_token_ids,
                [
                    CompletionOutput(
                        0, self.engine.text(r), r.output_token_ids, r.status.value, r.stop_reason, r.logprobs
                    )
                ],
            )
            for r, p in zip(reqs, prompts)
        ]
