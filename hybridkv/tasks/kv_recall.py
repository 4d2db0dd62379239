"""kv_recall: recall the code bound to a key, many sliding windows back.

A context binds 4-10 keys to codes among 8-20 distractor notes, then asks for one key's code:

    Remember these codes.
    - note: box is wet.
    - sky 11
    - bee 91
    - note: owl is far.
    - tea 0871
    ...
    - owl 3378
    Q: what is bee?
    A: bee                      <- the prompt ends here (100-250 tokens of the default model's tokenizer)
     91                         <- the answer, then a newline

Keys are distinct 3-letter words; codes are 2-4 digits, no two in a context starting with the same digit;
notes mention keys, bound or not, but never carry digits. The answer is ` <code>`, ended by a newline (the
default model's generation config stops on it, or on EOS). `score`: the generated text up to its first
newline, stripped, equals the code. Held-out items ask one question, never about the last binding, so the
code is at least 16 tokens back; training texts ask 1-6 questions, each answered before the next.

As a chat (`fewshot_messages`, the shape lm-eval's `local-chat-completions` sends with `num_fewshot=k` and
`apply_chat_template=True`): k solved items as user/assistant turns, then the item's prompt as the last user turn.
Shots come from a pool of keys (`SHOT_KEYS`) that held-out items never use, so the asked key is bound once in the
conversation (shots may bind the same shot key to different codes; their answers are given): the model has no
notion of "the latest binding wins", and a shot binding the asked key would be a different task. Codes do collide
across contexts (first digits, often more), so only the asked key picks the right one.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

KEYS = (
    "ant", "ape", "arm", "axe", "bag", "bat", "bed", "bee", "bow", "box", "bus", "cap", "car", "cat", "cow", "cup",
    "dog", "ear", "egg", "elk", "elm", "eye", "fan", "fig", "fox", "gem", "hat", "hen", "hut", "ink", "jam", "jar",
    "jet", "kit", "leg", "log", "map", "mat", "mop", "mud", "net", "nut", "oak", "orb", "owl", "pan", "pen", "pig",
    "pin", "pot", "ram", "rat", "rod", "rug", "saw", "sea", "sky", "sun", "tea", "tin", "toy", "van", "web", "yak",
)  # fmt: skip
SHOT_KEYS = (
    "ash", "bun", "cod", "dam", "den", "dew", "elf", "emu", "fin", "fog", "gum", "hog", "hop", "ivy", "jug", "keg",
    "kid", "lid", "lip", "mug", "nib", "oar", "pea", "pod", "pub", "rib", "rye", "sap", "sod", "tub", "urn", "vat",
)  # fmt: skip
FEWSHOT_SEED, FEWSHOT_SIZE = 4321, 64  # the few-shot pool a model folder ships as fewshot.jsonl
NOTE_WORDS = ("old", "new", "red", "far", "wet", "hot")
HEADER = "Remember these codes."
BINDINGS = (4, 10)  # bindings per context, inclusive; at most 10: values start with distinct digits
NOTES = (8, 20)  # distractor notes per context


Values = Callable[[random.Random, int], list[str]]  # (rng, n) -> n codes, no two starting with the same digit


def _values(rng: random.Random, n: int) -> list[str]:
    """n values of 2-4 digits, no two starting with the same digit."""
    return [
        str(d) + "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3))) for d in rng.sample(range(10), n)
    ]


def code_family(rng: random.Random) -> Values:
    """Values for contexts that must be told apart by their keys alone: every code shares its first digit, and
    often more, with the family's code for that digit (one per digit, drawn once), then differs."""
    base = _values(rng, 10)
    by_digit = {int(code[0]): code for code in base}

    def values(rng: random.Random, n: int) -> list[str]:
        out = []
        for d in rng.sample(range(10), n):
            stem = by_digit[d][: rng.randint(1, len(by_digit[d]) - 1)]  # keeps the first digit, drops at least one
            code = by_digit[d]
            while code == by_digit[d]:
                code = stem + "".join(
                    rng.choice("0123456789") for _ in range(rng.randint(2 - min(2, len(stem)), 4 - len(stem)))
                )
            out.append(code)
        return out

    return values


def make_context(
    rng: random.Random,
    bindings: tuple[int, int] = BINDINGS,
    notes: tuple[int, int] = NOTES,
    keys: tuple[str, ...] | list[str] = KEYS,
    codes: Values = _values,
) -> tuple[str, dict[str, str]]:
    """A context of bindings with distractor notes mixed in (all drawn from `keys`), and its key -> value map."""
    n = rng.randint(*bindings)
    values = dict(zip(rng.sample(keys, n), codes(rng, n)))
    lines = [f"- {k} {v}" for k, v in values.items()]
    for _ in range(rng.randint(*notes)):
        lines.insert(rng.randint(0, len(lines)), f"- note: {rng.choice(keys)} is {rng.choice(NOTE_WORDS)}.")
    return "\n".join([HEADER, *lines, ""]), values


def question(key: str) -> str:
    return f"Q: what is {key}?\nA: {key}"


def make_item(rng: random.Random, keys: tuple[str, ...] | list[str] = KEYS, codes: Values = _values) -> dict[str, str]:
    """A held-out item: one question, never about the last binding; its value is 16+ tokens back."""
    context, values = make_context(rng, keys=keys, codes=codes)
    key = rng.choice(list(values)[:-1])
    return {"prompt": context + question(key), "answer": " " + values[key]}


def make_training_text(
    rng: random.Random, bindings: tuple[int, int] = BINDINGS, notes: tuple[int, int] = NOTES, max_queries: int = 6
) -> tuple[str, list[tuple[int, int]]]:
    """A training text with 1..max_queries questions, and the character spans of its answers (newline included)."""
    text, values = make_context(rng, bindings, notes)
    spans = []
    for key in rng.sample(list(values), rng.randint(1, min(max_queries, len(values)))):
        text += question(key)
        answer = " " + values[key] + "\n"
        spans.append((len(text), len(text) + len(answer)))
        text += answer
    return text, spans


def fewshot_messages(item: dict[str, str], shots: list[dict[str, str]]) -> list[dict[str, str]]:
    """The chat lm-eval sends for `item` with these shots: each shot's prompt and answer as a user and an
    assistant turn, then the item's prompt."""
    turns = [[{"role": "user", "content": s["prompt"]}, {"role": "assistant", "content": s["answer"]}] for s in shots]
    return [m for turn in turns for m in turn] + [{"role": "user", "content": item["prompt"]}]


def make_training_chat(
    rng: random.Random,
    shots: int,
    bindings: tuple[int, int] = BINDINGS,
    notes: tuple[int, int] = NOTES,
    codes: Values = _values,
) -> list[dict[str, str]]:
    """A chat to train on: `shots` solved items (the few-shot shape), then a context asked 1-3 questions, each
    answered, the later ones as short follow-up turns. Every assistant turn is an answer, and no key is bound
    twice in the chat: the model has no notion of "the latest binding wins". `codes=code_family(rng)` makes
    the contexts' codes share prefixes, so that only the asked key tells the right one from the others."""
    context, values = make_context(rng, bindings, notes, codes=codes)
    bound = set(values)
    solved = []
    for _ in range(shots):
        solved.append(make_item(rng, [k for k in KEYS + SHOT_KEYS if k not in bound], codes))
        bound |= {line.split()[1] for line in solved[-1]["prompt"].splitlines() if re.fullmatch(r"- \w+ \d+", line)}
    messages = fewshot_messages({"prompt": ""}, solved)[:-1]
    for i, key in enumerate(rng.sample(list(values), rng.randint(1, min(3, len(values))))):
        messages.append({"role": "user", "content": (context if i == 0 else "") + question(key)})
        messages.append({"role": "assistant", "content": " " + values[key]})
    return messages


def score(prediction: str, answer: str) -> bool:
    """Exact match of the generated text up to its first newline, both sides stripped."""
    return prediction.split("\n", 1)[0].strip() == answer.strip()


def make_items(n: int, seed: int, keys: tuple[str, ...] = KEYS) -> list[dict[str, str]]:
    """n held-out items (or, with keys=SHOT_KEYS, a few-shot pool) from random.Random(seed)."""
    rng = random.Random(seed)
    return [make_item(rng, keys) for _ in range(n)]


def fewshot_pool() -> list[dict[str, str]]:
    """The seeded few-shot pool: what a model folder ships as fewshot.jsonl."""
    return make_items(FEWSHOT_SIZE, FEWSHOT_SEED, SHOT_KEYS)


def write_jsonl(path: str | Path, items: list[dict[str, str]]) -> None:
    Path(path).write_text("".join(json.dumps(item) + "\n" for item in items))


def read_jsonl(path: str | Path) -> list[dict[str, str]]:
    """{prompt, answer} items, one JSON object per line; a malformed or empty file is a ValueError naming it."""
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or "answer" not in item:
            raise ValueError(f"{path}:{n}: each line needs a string 'prompt' and an 'answer'")
        items.append(item)
    if not items:
        raise ValueError(f"{path} holds no items")
    return items
