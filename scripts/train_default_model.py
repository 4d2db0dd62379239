"""Train hybridkv's default model: a tiny Gemma 4 text model that answers kv_recall questions.

    python scripts/train_default_model.py                  # the shipped model: ~N min on 2 CPU cores
    python scripts/train_default_model.py --out /tmp/m --threads 1

Writes a standard HF folder to --out (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json) plus `heldout.jsonl` (256 kv_recall items, seed 1234), then scores the folder with
scripts/eval_hf.py. Everything is seeded: the tokenizer is trained on generated text, the model is transformers'
`Gemma4ForCausalLM`, and every batch comes from one `random.Random(seed)`; the loss covers answer tokens only
(the value and the newline that ends it), as everything else is random bindings.

Layers [S, F, S, S, F, S, S, F], a 16-token window, sliding head size 32, full head size 64; the last 3 layers
are KV-sharing consumers: 5 and 6 read layer 3's sliding KV, 7 reads layer 4's full KV. Values sit 16 to 250
tokens before the question, so only full attention can fetch them, and training puts that lookup in layer 7:
for the first 80% of the steps the full layers that own KV (1 and 4) see only the window, so the lookup can
only be learned where it is most fragile, in the consumer reading layer 4's KV. Then they train unrestricted.
A consumer that reads the wrong layer, or a full layer cut to the window, then gets almost every answer wrong.

Training also grows the contexts (2-4 bindings and 0-2 notes at first, the held-out ranges after a third of the
steps) and starts the post-attention/MLP norms at 0.1 and the attention logits near unit scale: without these
the lookup is not found within the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import time
from pathlib import Path

import torch
from eval_hf import evaluate, windowed  # scripts/eval_hf.py
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig, PreTrainedTokenizerFast

from hybridkv.tasks import kv_recall

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "hybridkv" / "assets" / "default-model"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3, Gemma's pad/eos/bos ids
HELDOUT_SEED, HELDOUT_SIZE = 1234, 256
S, F = "sliding_attention", "full_attention"


def train_tokenizer(
    seed: int, vocab_size: int = 512, n_texts: int = 4000, max_length: int = 512
) -> PreTrainedTokenizerFast:
    """Byte-level BPE over generated task text; a digit is one token (with the space before it); BOS is prepended."""
    rng = random.Random(seed)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r" ?\d"), "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((kv_recall.make_training_text(rng)[0] for _ in range(n_texts)), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def model_config(vocab_size: int, hidden: int, intermediate: int) -> Gemma4TextConfig:
    return Gemma4TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        sliding_window=16,
        layer_types=[S, F, S, S, F, S, S, F],
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab_size,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        dtype="float32",
    )


def init_weights(model: Gemma4ForCausalLM) -> None:
    """Unit-scale embeddings and attention logits; residual branches start at 0.1 so tokens stay visible deep."""
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, model.config.hidden_size**-0.5)
        for layer in model.model.layers:
            attn = layer.self_attn
            for norm in (attn.q_norm, getattr(attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.fill_(attn.head_dim**-0.25)
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.fill_(0.1)
            if hasattr(layer, "post_per_layer_input_norm"):
                layer.post_per_layer_input_norm.weight.fill_(0.1)


def curriculum(progress: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """Bindings and notes ranges: short contexts first, the held-out ranges from `progress` 1 on."""
    f = min(1.0, progress)
    (b_lo, b_hi), (n_lo, n_hi) = kv_recall.BINDINGS, kv_recall.NOTES
    return (round(2 + (b_lo - 2) * f), round(4 + (b_hi - 4) * f)), (round(n_lo * f), round(2 + (n_hi - 2) * f))


def make_batch(
    rng: random.Random, tok: PreTrainedTokenizerFast, size: int, progress: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and a mask [B, T] of the tokens to predict (answers and their newline)."""
    bindings, notes = curriculum(progress)
    n, m = rng.randint(*bindings), rng.randint(*notes)  # one size per batch: little padding
    texts, spans = zip(*(kv_recall.make_training_text(rng, (n, n), (m, m)) for _ in range(size)))
    enc = tok(list(texts), return_offsets_mapping=True, padding=True, return_tensors="pt")
    starts = enc["offset_mapping"][..., 0]
    target = torch.zeros_like(enc["input_ids"], dtype=torch.bool)
    for b, item_spans in enumerate(spans):
        real = enc["attention_mask"][b].bool()
        real[0] = False  # BOS has offsets (0, 0)
        for lo, hi in item_spans:
            target[b] |= real & (starts[b] >= lo) & (starts[b] < hi)
    return enc["input_ids"], target


def answer_stats(model: Gemma4ForCausalLM, ids: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """Loss over answer tokens and the fraction of answers whose every token is the argmax (= greedy exact match)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    labels, mask = ids[:, 1:], target[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[mask], labels[mask])
    right = (logits.argmax(-1) == labels) | ~mask
    # An answer is a run of target tokens, numbered across the batch by where runs start.
    starts = mask & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1]
    run = starts.flatten().cumsum(0).view_as(mask)
    return loss.item(), 1 - run[~right].unique().numel() / int(starts.sum())


def train_step(model, opt: torch.optim.Optimizer, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One optimizer step on the answer tokens (`target` marks them); returns the loss."""
    model.train()
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    mask = target[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[mask].float(), ids[:, 1:][mask])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def report(model, val: list, label: str, step: int, loss: torch.Tensor, t0: float) -> float:
    """Print the validation loss and exact-answer rate after `step`; returns the rate."""
    model.eval()
    with torch.no_grad():
        val_loss, val_acc = (sum(x) / len(val) for x in zip(*(answer_stats(model, *b) for b in val)))
    print(f"{label} {step:5d}  loss {loss.item():.3f}  val loss {val_loss:.3f}  val exact {val_acc:.3f}  "
          f"{time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
    return val_acc


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def kv_owning_full_layers(config: Gemma4TextConfig) -> set[int]:
    modes = config.kv_sharing_modes
    return {i for i, t in enumerate(config.layer_types) if t == F and modes[i] != "reuse"}


# The model is trained on raw kv_recall prompts, not dialogues: a chat renders its turns' text as that prompt.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--grow", type=float, default=1 / 3, help="fraction of steps over which contexts grow")
    ap.add_argument("--owners-windowed", type=float, default=0.8, help="fraction of steps with KV owners windowed")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tok = train_tokenizer(args.seed)
    model = Gemma4ForCausalLM(model_config(len(tok), args.hidden, args.intermediate))
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tok)} tokens; model: {n_params / 1e6:.2f}M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    data_rng, val_rng = random.Random(args.seed), random.Random(args.seed + 1)
    val = [make_batch(val_rng, tok, 32) for _ in range(2)]
    owners = kv_owning_full_layers(model.config)
    restricted = contextlib.ExitStack()
    restricted.enter_context(windowed(owners, model.config.sliding_window))
    for step in range(args.steps):
        if step == int(args.owners_windowed * args.steps):
            restricted.close()
            print(f"step {step:5d}  full layers {sorted(owners)} see the whole context from here", flush=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = train_step(model, opt, *make_batch(data_rng, tok, args.batch, step / (args.grow * args.steps)))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            report(model, val, "step", step + 1, loss, t0)

    args.out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(args.out)
    newline = tok.convert_tokens_to_ids("Ċ")
    GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, newline], pad_token_id=tok.pad_token_id
    ).save_pretrained(args.out)
    tok.backend_tokenizer.no_padding()  # batching turned it on; a served tokenizer should not pad
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(args.out)
    kv_recall.write_jsonl(args.out / "heldout.jsonl", kv_recall.make_items(HELDOUT_SIZE, HELDOUT_SEED))
    print(f"trained and saved to {args.out} in {time.perf_counter() - t0:.0f}s", flush=True)
    evaluate(args.out, args.out / "heldout.jsonl", ["normal", "wrong-kv", "windowed"])
    print(f"total {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
