"""Tokenizer: a model folder's tokenizer.json through the `tokenizers` library (fast to load)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json: pass token ids, or add the tokenizer files")
        self._tok = _HFTokenizer.from_file(str(path))
        # A token covers at most this many characters of text: its vocabulary string spells each byte (byte-level
        # BPE) or character (SentencePiece) it covers. `max_chars` uses it to refuse a text by length before
        # tokenizing it.
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def max_chars(self, num_tokens: int) -> int:
        """The most characters a text of `num_tokens` tokens can have (a tokenizer whose normalizer deletes text
        may fit more; such a text is refused, never tokenized)."""
        return num_tokens * self.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens`: the tokenizer's own (a BOS, say); False for text that already spells them, as a
        rendered chat template does."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_within(self, text: str, max_model_len: int, add_special_tokens: bool = True) -> list[int]:
        """`encode`, for a prompt that may fit `max_model_len`: a text too long to fit is a ValueError, without
        being tokenized."""
        bound = self.max_chars(max_model_len - 1)
        if len(text) > bound:
            raise ValueError(
                f"the prompt has {len(text)} characters; max_model_len is {max_model_len} tokens, which with this "
                f"tokenizer (longest token: {self.max_token_chars} characters) hold at most {bound}: shorten it"
            )
        return self.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (for logprobs)."""
        return self._tok.decode([token_id], skip_special_tokens=False)


def eos_token_ids(model_dir: str | Path, hf_config: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json (an int or a list in either)."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    sources = [json.loads(gen.read_text())] if gen.is_file() else []
    sources.append(hf_config.get("text_config", hf_config))
    sources.append(hf_config)
    for src in sources:
        value = src.get("eos_token_id")
        if value is not None:
            ids.update(value if isinstance(value, list) else [value])
            break
    return tuple(sorted(ids))
