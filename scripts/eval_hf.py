"""Score a model folder on the kv_recall held-out set with transformers: greedy, float32, KV cache on.

    python scripts/eval_hf.py                      # the shipped default model: normal and both KV bugs
    python scripts/eval_hf.py --model DIR --runs normal --data items.jsonl
    python scripts/eval_hf.py --chat-shots 0 5          # also as chats after 0 and 5 shots (fewshot.jsonl)

Besides the model as trained, two runs break its KV reads on purpose; each must score far lower:
  wrong-kv   the KV-sharing consumers read the previous KV owner of their type instead of the last one (a
             consumer mapped to the wrong target layer): full layer 7 reads layer 1, not 4; sliding layers
             5 and 6 read layer 2, not 3.
  windowed   every full-attention layer sees only the sliding window (full layers given a window).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybridkv.tasks import kv_recall

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "hybridkv" / "assets" / "default-model"


@contextlib.contextmanager
def windowed(layers: set[int], window: int) -> Iterator[None]:
    """Layers in `layers` attend under a sliding-window mask (query i sees keys i-window+1..i); sdpa only."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx in layers:
            q, k = query.shape[-2], key.shape[-2]
            i = torch.arange(k - q, k, device=query.device)[:, None]
            j = torch.arange(k, device=query.device)[None, :]
            allowed = (j <= i) & (i - j < window)
            if attention_mask is None:
                attention_mask = allowed
            elif attention_mask.dtype == torch.bool:
                attention_mask = attention_mask & allowed
            else:
                attention_mask = attention_mask.masked_fill(~allowed, torch.finfo(attention_mask.dtype).min)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = attention
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]


@contextlib.contextmanager
def consumers_read_wrong_layer(model) -> Iterator[None]:
    """Move each type's KV store to the previous KV owner of that type, so the consumers read its KV."""
    attns = [layer.self_attn for layer in model.model.layers]
    owners = [a for a in attns if not a.is_kv_shared_layer]
    moved = []
    for store in [a for a in attns if a.store_full_length_kv]:
        earlier = [a for a in owners if a.layer_type == store.layer_type and a.layer_idx < store.layer_idx]
        if earlier:
            store.store_full_length_kv, earlier[-1].store_full_length_kv = False, True
            moved.append((store, earlier[-1]))
    try:
        yield
    finally:
        for store, wrong in moved:
            store.store_full_length_kv, wrong.store_full_length_kv = True, False


def runs(model) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    full = {i for i, t in enumerate(model.config.layer_types) if t == "full_attention"}
    return {
        "normal": contextlib.nullcontext,
        "wrong-kv": lambda: consumers_read_wrong_layer(model),
        "windowed": lambda: windowed(full, model.config.sliding_window),
    }


def greedy(model, tok, prompts: list[str], batch_size: int, max_new_tokens: int = 8) -> list[str]:
    """Left-padded batched greedy decoding; the generated text, special tokens dropped."""
    tok.padding_side = "left"
    outs = []
    for lo in range(0, len(prompts), batch_size):
        enc = tok(prompts[lo : lo + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, use_cache=True)
        outs += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return outs


def chat_prompts(tok, items: list[dict[str, str]], shots: int, pool: list[dict[str, str]]) -> list[str]:
    """Each item after `shots` shots from `pool` (chosen by random.Random(index)), through the chat template."""
    return [
        tok.apply_chat_template(
            kv_recall.fewshot_messages(it, random.Random(i).sample(pool, shots)),
            tokenize=False,
            add_generation_prompt=True,
        )
        for i, it in enumerate(items)
    ]


def accuracy(model, tok, items: list[dict[str, str]], batch_size: int = 64, prompts: list[str] | None = None) -> float:
    preds = greedy(model, tok, prompts or [it["prompt"] for it in items], batch_size)
    return sum(kv_recall.score(p, it["answer"]) for p, it in zip(preds, items)) / len(items)


def load(model_dir: Path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def evaluate(
    model_dir: Path, data: Path, names: list[str], batch_size: int = 64, chat_shots: tuple[int, ...] = ()
) -> dict[str, float]:
    """Accuracy per run in `names`: on the raw prompts, then as chats after each count in `chat_shots`."""
    model, tok = load(model_dir)
    items = kv_recall.read_jsonl(data)
    print(f"kv_recall: {len(items)} items from {data}; transformers, float32, greedy")
    pool = kv_recall.read_jsonl(model_dir / "fewshot.jsonl") if chat_shots else []
    shapes = {"raw": None} | {f"chat {k}-shot": chat_prompts(tok, items, k, pool) for k in chat_shots}
    scores = {}
    for shape, prompts in shapes.items():
        for name in names:
            start = time.perf_counter()
            with runs(model)[name]():
                scores[f"{shape} {name}"] = accuracy(model, tok, items, batch_size, prompts)
            took = time.perf_counter() - start
            print(f"  {shape:<12} {name:<10} accuracy {scores[f'{shape} {name}']:.3f}   ({took:.1f}s)", flush=True)
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--data", type=Path, help="jsonl of {prompt, answer}; default: heldout.jsonl in --model")
    ap.add_argument("--runs", nargs="+", default=["normal", "wrong-kv", "windowed"])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--chat-shots", type=int, nargs="*", default=[], help="also score as chats after k shots")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    data = args.data or args.model / "heldout.jsonl"
    evaluate(args.model, data, args.runs, args.batch_size, tuple(args.chat_shots))


if __name__ == "__main__":
    main()
