"""What the sweep asks a server (or router): greedy completions of prompts, and the lm-eval held-out score."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from hybridkv.pd_accuracy.checks import Completion


def greedy(url: str, model_name: str, prompts: list[str], max_tokens: int, concurrency: int = 4) -> list[Completion]:
    """Each prompt's greedy completion (EOS ignored) with its tokens' logprobs, one request per prompt,
    `concurrency` at a time."""

    def one(prompt: str) -> Completion:
        body = {"model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "logprobs": 1}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        if reply.status_code != 200:
            raise RuntimeError(f"POST {url}/v1/completions: HTTP {reply.status_code}: {reply.text[:300]}")
        choice = reply.json()["choices"][0]
        return Completion(choice["text"], tuple((choice.get("logprobs") or {}).get("token_logprobs") or ()))

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def lm_eval_score(
    url: str,
    model_name: str,
    data: Path,
    *,
    limit: int | None,
    num_concurrent: int,
    chat: bool,
    num_fewshot: int,
    tokenizer: Path | None,
    fewshot: Path | None = None,
) -> float:
    """hybridkv.evals.lm_eval_server_accuracy through `url`: `num_fewshot` shots from `fewshot` (default: the
    seeded pool), lm-eval's tokenizer from the folder `tokenizer` (else none)."""
    from hybridkv.evals import lm_eval_server_accuracy

    return lm_eval_server_accuracy(
        url,
        model_name,
        data,
        limit=limit,
        num_concurrent=num_concurrent,
        chat=chat,
        num_fewshot=num_fewshot,
        tokenizer=tokenizer,
        fewshot=fewshot,
    )
