"""Train hybridkv's default model: a tiny Gemma 4 text model that answers kv_recall questions, raw and as chats.

    python scripts/train_default_model.py                  # the shipped model: ~27-31 min on 2 CPU cores
    python scripts/train_default_model.py --out /tmp/m --save-raw /tmp/raw    # keep the raw phase's model too
    python scripts/train_default_model.py --out /tmp/m --raw-from /tmp/raw    # only the chat phase, from it

Writes a standard HF folder to --out (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja) plus `heldout.jsonl` (256 kv_recall items, seed 1234) and
`fewshot.jsonl` (kv_recall's seeded few-shot pool), then scores the folder with scripts/eval_hf.py, raw and as
0- and 5-shot chats. Everything is seeded: the tokenizer is trained on generated text, the model is transformers'
`Gemma4ForCausalLM`, and every batch comes from a `random.Random` of the seed; the loss covers answer tokens only
(the value and what ends it), as everything else is random bindings.

Layers [S, F, S, S, F, S, S, F], a 16-token window, sliding head size 32, full head size 64, 4096 positions; the
last 3 layers are KV-sharing consumers: 5 and 6 read layer 3's sliding KV, 7 reads layer 4's full KV.

Phase 1 (raw text, 1500 steps): values sit 16 to 250 tokens before the question, so only full attention can
fetch them, and training puts that lookup in layer 7: for the first 80% of the steps the full layers that own KV
(1 and 4) see only the window, so the lookup can only be learned where it is most fragile, in the consumer
reading layer 4's KV. Then they train unrestricted. A consumer that reads the wrong layer, or a full layer cut to
the window, then gets almost every answer wrong. Training also grows the contexts (2-4 bindings and 0-2 notes at
first, the held-out ranges after a third of the steps) and starts the post-attention/MLP norms at 0.1 and the
attention logits near unit scale: without these the lookup is not found within the budget.

Phase 2 (chats, scripts/default_model_chat.py): the turn markers join the vocabulary, and steps mix raw texts
with chats after 0-5 solved shots (lm-eval's few-shot shape, up to ~1200 tokens), the KV owners windowed again
for most of the steps so that the lookup stays in layer 7.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import random
import time
from pathlib import Path

import torch
from default_model_chat import CHAT_TEMPLATE, END, add_turn_tokens, make_chat_batch  # scripts/default_model_chat.py
from eval_hf import evaluate, windowed  # scripts/eval_hf.py
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig, PreTrainedTokenizerFast

from hybridkv.tasks import kv_recall

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "hybridkv" / "assets" / "default-model"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # ids 0..3, Gemma's pad/eos/bos ids
HELDOUT_SEED, HELDOUT_SIZE = 1234, 256
S, F = "sliding_attention", "full_attention"
MAX_POSITIONS = 4096  # the chat phase's model: five shots and a question are ~1200 tokens


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


class OwnersWindowed:
    """The KV-owning full layers attend under the sliding window for the first `until` steps, then see the whole
    context (`at(step)` lifts it when `step` reaches `until`; `close()` lifts it in any case)."""

    def __init__(self, config: Gemma4TextConfig, until: int, label: str) -> None:
        self.owners, self.until, self.label = kv_owning_full_layers(config), until, label
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(windowed(self.owners, config.sliding_window))

    def at(self, step: int) -> None:
        if step == self.until:
            self.stack.close()
            lifted = f"full layers {sorted(self.owners)} see the whole context from here"
            print(f"{self.label} {step:5d}  {lifted}", flush=True)

    def close(self) -> None:
        self.stack.close()


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


# The GDN model (scripts/train_gdn_model.py) is trained on raw prompts only: a chat renders as its turns' text.
CONCAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def raw_phase(args, tok: PreTrainedTokenizerFast, t0: float) -> Gemma4ForCausalLM:
    """Phase 1: kv_recall as raw text, the lookup forced into the consumer layer 7 for most of the steps."""
    torch.manual_seed(args.seed)
    model = Gemma4ForCausalLM(model_config(len(tok), args.hidden, args.intermediate))
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tok)} tokens; model: {n_params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    data_rng, val_rng = random.Random(args.seed), random.Random(args.seed + 1)
    val = [make_batch(val_rng, tok, 32) for _ in range(2)]
    restricted = OwnersWindowed(model.config, int(args.owners_windowed * args.steps), "step")
    for step in range(args.steps):
        restricted.at(step)
        set_lr(opt, lr_at(step, args.steps, args.lr, args.warmup))
        loss = train_step(model, opt, *make_batch(data_rng, tok, args.batch, step / (args.grow * args.steps)))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            report(model, val, "step", step + 1, loss, t0)
    restricted.close()
    return model


def chat_phase(args, tok: PreTrainedTokenizerFast, model: Gemma4ForCausalLM, t0: float) -> Gemma4ForCausalLM:
    """Phase 2: the turn markers join the vocabulary; steps mix raw texts (a `--chat-raw` share) and chats after
    0-5 shots; the KV-owning full layers stay windowed for the first `--owners-windowed` of the steps again."""
    model = add_turn_tokens(tok, model, args.seed)
    model.config.max_position_embeddings = tok.model_max_length = MAX_POSITIONS
    opt = torch.optim.AdamW(model.parameters(), lr=args.chat_lr, betas=(0.9, 0.98), weight_decay=0.05)
    data_rng, val_rng = random.Random(args.seed + 2), random.Random(args.seed + 3)
    vals = {"raw": [make_batch(val_rng, tok, 32)]}
    vals |= {f"chat{k}": [make_chat_batch(val_rng, tok, 16, k)] for k in (0, 5)}
    restricted = OwnersWindowed(model.config, int(args.owners_windowed * args.chat_steps), "chat")
    for step in range(args.chat_steps):
        restricted.at(step)
        set_lr(opt, lr_at(step, args.chat_steps, args.chat_lr, args.warmup))
        if data_rng.random() < args.chat_raw:
            batch = make_batch(data_rng, tok, args.batch)
        else:
            shots, family = data_rng.randint(0, 5), data_rng.random() < args.chat_family
            batch = make_chat_batch(data_rng, tok, args.chat_batch, shots, family)
        loss = train_step(model, opt, *batch)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.chat_steps:
            for name, val in vals.items():
                report(model, val, f"chat {name:<5}", step + 1, loss, t0)
    restricted.close()
    return model


def save(model: Gemma4ForCausalLM, tok: PreTrainedTokenizerFast, out: Path, chat_template: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(out)
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("Ċ")]  # EOS, newline
    if chat_template:
        stops.append(tok.convert_tokens_to_ids(END))
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=stops, pad_token_id=tok.pad_token_id).save_pretrained(
        out
    )
    tok.backend_tokenizer.no_padding()  # batching turned it on; a served tokenizer should not pad
    tok.chat_template = chat_template or CONCAT_TEMPLATE
    tok.save_pretrained(out)
    kv_recall.write_jsonl(out / "heldout.jsonl", kv_recall.make_items(HELDOUT_SIZE, HELDOUT_SEED))
    kv_recall.write_jsonl(out / "fewshot.jsonl", kv_recall.fewshot_pool())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500, help="raw phase steps")
    ap.add_argument("--batch", type=int, default=16, help="raw texts per batch")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--grow", type=float, default=1 / 3, help="fraction of steps over which contexts grow")
    ap.add_argument("--owners-windowed", type=float, default=0.8, help="fraction of steps with KV owners windowed")
    ap.add_argument("--chat-steps", type=int, default=600, help="chat phase steps")
    ap.add_argument("--chat-batch", type=int, default=8, help="chats per batch")
    ap.add_argument("--chat-lr", type=float, default=1e-3)
    ap.add_argument("--chat-raw", type=float, default=0.25, help="share of chat phase steps on raw texts")
    ap.add_argument("--chat-family", type=float, default=0.5, help="share of chats whose codes share prefixes")
    ap.add_argument("--save-raw", type=Path, help="also save the raw phase's model here")
    ap.add_argument("--raw-from", type=Path, help="skip the raw phase: start from a --save-raw folder")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tok = train_tokenizer(args.seed)
    if args.raw_from:
        model = Gemma4ForCausalLM.from_pretrained(args.raw_from, dtype=torch.float32)
        print(f"raw phase from {args.raw_from}", flush=True)
    else:
        model = raw_phase(args, tok, t0)
        if args.save_raw:
            save(model, copy.deepcopy(tok), args.save_raw, None)
    model = chat_phase(args, tok, model, t0)
    save(model, tok, args.out, CHAT_TEMPLATE)
    print(f"trained and saved to {args.out} in {time.perf_counter() - t0:.0f}s", flush=True)
    evaluate(args.out, args.out / "heldout.jsonl", ["normal", "wrong-kv", "windowed"], chat_shots=(0, 5))
    print(f"total {time.perf_counter() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
