"""The default model's chat phase: turn markers, the chat template, and training on kv_recall as dialogues.

A chat renders as `<|user|>` + the user's text, then `<|model|>` + the answer + `<|end|>` per assistant turn; the
generation prompt is `<|model|>`. Five shots and a question, the shape lm-eval's `local-chat-completions` sends
with `num_fewshot=5, apply_chat_template=True`, become one sequence:

    <bos><|user|>Remember these codes.\n- elf 12\n ... Q: what is elf?\nA: elf<|model|> 12<|end|><|user|>Remember ...
    ... Q: what is bee?\nA: bee<|model|>                       <- the model answers ` 91` and `<|end|>`

The marker sits right after the asked key, one token between key and answer: the raw model's lookup (at the
key's position, find the binding of the key and copy its code) only has to read the key one token back.
The three markers are added to the raw phase's tokenizer as special tokens after the BPE is trained, so raw text
tokenizes exactly as before and the raw phase's weights carry over with three new embedding rows.
"""

from __future__ import annotations

import random
import re

import torch
from transformers import Gemma4ForCausalLM, PreTrainedTokenizerFast

from hybridkv.tasks import kv_recall

USER, MODEL, END = "<|user|>", "<|model|>", "<|end|>"
TURN_TOKENS = [USER, MODEL, END]
# System turns (lm-eval's system_instruction) render as user turns: the model was never trained on them.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}" + MODEL + "{{ message['content'] }}" + END + ""
    "{%- else -%}" + USER + "{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + MODEL + "{%- endif -%}"
)
_ANSWER = re.compile(re.escape(MODEL) + r"(.*?)" + re.escape(END), re.S)


def add_turn_tokens(tok: PreTrainedTokenizerFast, model: Gemma4ForCausalLM, seed: int) -> Gemma4ForCausalLM:
    """Append the turn markers to the vocabulary; a model with three more embedding rows (both tables), drawn at
    the scale of the existing rows from torch.Generator(seed). Every other weight is copied bit for bit."""
    old = len(tok)
    tok.add_special_tokens({"additional_special_tokens": TURN_TOKENS})
    if [tok.convert_tokens_to_ids(t) for t in TURN_TOKENS] != list(range(old, old + len(TURN_TOKENS))):
        raise RuntimeError("turn markers did not get the ids after the BPE vocabulary")
    config = model.config
    config.vocab_size = config.vocab_size_per_layer_input = len(tok)
    grown = Gemma4ForCausalLM(config)
    state = model.state_dict()
    gen = torch.Generator().manual_seed(seed)
    for name in ("model.embed_tokens.weight", "model.embed_tokens_per_layer.weight"):
        table = state[name]
        rows = torch.randn(len(TURN_TOKENS), table.shape[1], generator=gen) * table.std()
        state[name] = torch.cat([table, rows.to(table.dtype)])
    state.pop("lm_head.weight", None)  # tied to embed_tokens
    missing, unexpected = grown.load_state_dict(state, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:  # lm_head is tied to embed_tokens
        raise RuntimeError(f"state did not carry over: missing {missing}, unexpected {unexpected}")
    grown.tie_weights()
    return grown


def render(tok: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> str:
    return tok.apply_chat_template(messages, tokenize=False, chat_template=CHAT_TEMPLATE)


def make_chat_batch(
    rng: random.Random, tok: PreTrainedTokenizerFast, size: int, shots: int, family: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] of `size` training chats after `shots` shots, and a mask [B, T] of the tokens to
    predict: every assistant turn's answer and the `<|end|>` that closes it. `family`: each chat's codes share
    prefixes across its contexts (kv_recall.code_family), so the code's later digits must follow the asked key,
    not the digits before them (a model that copies by the digits fails after five random shots, where codes
    collide on their first digits)."""
    texts = []
    for _ in range(size):
        codes = kv_recall.code_family(rng) if family else kv_recall._values
        texts.append(render(tok, kv_recall.make_training_chat(rng, shots, codes=codes)))
    enc = tok(texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
    starts = enc["offset_mapping"][..., 0]
    target = torch.zeros_like(enc["input_ids"], dtype=torch.bool)
    for b, text in enumerate(texts):
        real = enc["attention_mask"][b].bool()
        real[0] = False  # BOS has offsets (0, 0)
        for m in _ANSWER.finditer(text):
            target[b] |= real & (starts[b] >= m.start(1)) & (starts[b] < m.end())
    return enc["input_ids"], target
