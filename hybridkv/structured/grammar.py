"""GrammarCompiler: a model's tokenizer in llguidance, compiled constraints cached by spec; GrammarMatcher: one
request's position in its constraint, the mask of tokens it allows next, advanced by each sampled token.

llguidance runs on the CPU, one matcher per request: the engine asks only constrained requests for a mask, so an
unconstrained request in the same batch costs nothing more (benchmarks/bench_grammar.py measured it against
xgrammar: a few microseconds per token either way; llguidance has no dependencies and reads tokenizer.json).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from hybridkv.structured.spec import StructuredOutputs

CACHE_SIZE = 256  # compiled constraints kept, least recently used first out


class GrammarMatcher:
    """One request's constraint state. Invariant: it has consumed exactly the request's output tokens, in order
    (a preempted request keeps its output, so its matcher stays valid when it is recomputed)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._m, self._vocab_size = matcher, vocab_size
        self._bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next. A finished (or failed) matcher allows only EOS.

        Computed on the engine thread, when asked: a worker thread computing it during the model's forward
        slowed the whole batch on a CPU machine (the forward uses the cores; benchmarks/bench_offline.py)."""
        llg_numpy.fill_next_token_bitmask(self._m, self._bitmask, 0)
        return torch.from_numpy(unpack_np(self._bitmask[0], self._vocab_size))

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False when the constraint does not allow it (the matcher then failed)."""
        return self._m.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """The constraint is complete: no token but EOS may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary (thread-safe: the server compiles off its event loop, the
    engine thread makes matchers). `vocab_size`: the model's logits width, which may exceed the tokenizer's."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json: structured output needs the model's tokenizer")
        if not eos_token_ids:
            raise ValueError(f"{model_dir} names no EOS token: structured output needs one to end a request")
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The compiled constraint (a matcher never advanced: a template to copy). ValueError says what is wrong
        with the spec."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as e:
            raise ValueError(f"{spec.field}: {e}") from e
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)  # slow ones release the GIL
        if template.is_error():
            raise ValueError(f"{spec.field}: {template.get_error().splitlines()[0]}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one request (a copy of the cached template: cheap once compiled)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), self.vocab_size)

    def allowed(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), vocab_size] bool: the tokens each matcher allows next."""
        return torch.stack([m.allowed() for m in matchers])


def unpack_np(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 words -> bool [vocab_size]; bit i of word w is token 32*w+i (the words are little-endian bytes)."""
    bits = np.unpackbits(words.astype("<i4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
