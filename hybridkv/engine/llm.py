"""LLM: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.request.outputs import CompletionOutput, RequestOutput
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request

# vLLM's prompt forms: text, token ids, or a dict (TextPrompt {"prompt"} / TokensPrompt {"prompt_token_ids"}).
Prompt = str | list[int] | Mapping[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def unpack_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache salt) of one prompt in any of vLLM's forms; a ValueError saying what to change."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(
            f"prompt keys {unknown} are not supported: give 'prompt' or 'prompt_token_ids' (and 'cache_salt')"
        )
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict takes one of 'prompt' (text) and 'prompt_token_ids' (ids)")
    text_or_ids = prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"])
    return text_or_ids, prompt.get("cache_salt")


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`model`: a Hugging Face model folder; None runs the embedded default model."""
        self.engine = LLMEngine(EngineConfig(model=model or str(DEFAULT_MODEL_DIR), **kwargs))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. `use_tqdm`: a progress bar on
        stderr with throughput estimates, on by default (vLLM's name and default; drawn with rich)."""
        if isinstance(prompts, (str, Mapping)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        unpacked = [unpack_prompt(p) for p in prompts]  # type: ignore[union-attr]
        params = sampling_params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(unpacked)
        if len(per_prompt) != len(unpacked):
            raise ValueError(f"{len(unpacked)} prompts but {len(per_prompt)} sampling params")
        reqs = []
        try:  # all or nothing: a bad prompt, or a step that fails, leaves no request behind
            for (p, salt), sp in zip(unpacked, per_prompt):
                reqs.append(self.engine.add_request(p, sp, cache_salt=salt))
            self._run(reqs, use_tqdm)
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
                prompt_logprobs=r.prompt_logprobs,
            )
            for r, (p, _) in zip(reqs, unpacked)
        ]

    def _run(self, reqs: list[Request], use_tqdm: bool) -> None:
        if not use_tqdm:
            while self.engine.has_unfinished():
                self.engine.step()
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("Processed prompts"), MofNCompleteColumn(), BarColumn(bar_width=8), TimeElapsedColumn(),
                   TextColumn("{task.fields[speed]}"))  # fits 80 columns  # fmt: skip
        start = time.monotonic()
        with Progress(*columns, console=Console(file=sys.stderr)) as bar:
            task = bar.add_task("prompts", total=len(reqs), speed="")
            while self.engine.has_unfinished():
                self.engine.step()
                done = [r for r in reqs if r.status.finished]
                seconds = max(time.monotonic() - start, 1e-9)
                given = sum(r.num_prompt_tokens for r in done) / seconds
                made = sum(len(r.output_token_ids) for r in reqs) / seconds
                speed = f"est. speed in {given:.0f} tok/s, out {made:.0f} tok/s"
                bar.update(task, completed=len(done), speed=speed)
