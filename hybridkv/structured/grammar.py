"""GrammarCompiler: a model's tokenizer in llguidance, compiled constraints cached by spec; GrammarMatcher: one
request's position in its constraint: whether it allows one token, the mask of all it allows next, advanced by each
sampled token.

Compiling happens before a request is queued (the server's compile pool, serve/compile_pool.py); the engine thread
only copies a compiled template, which travels with the request, so an evicted cache entry is never compiled
there. llguidance runs on the CPU, one matcher per request, on the engine thread. Only constrained rows ask, and they
ask `allows` about a token or a few (the greedy best, a draw) before they build a mask (runner/sampler.py): after the
model's forward the caches are cold and a mask costs ~150 us on the tiny benchmark model, a check ~20 us.
benchmarks/bench_grammar.py measured llguidance against xgrammar: a few microseconds per token either way, warm;
llguidance has no dependencies and reads tokenizer.json.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import torch

from hybridkv.structured.limits import FAILED_CACHE_SIZE, parser_limits
from hybridkv.structured.spec import StructuredOutputs

CACHE_SIZE = 256  # compiled constraints kept, least recently used first out


class GrammarMatcher:
    """One request's constraint state. Invariant: it has consumed exactly the request's output tokens, in order
    (a preempted request keeps its output, so its matcher stays valid when it is recomputed)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._m, self._vocab_size, self._eos = matcher, vocab_size, eos_token_ids
        self._words = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)  # llguidance writes the mask here

    def allows(self, token_id: int) -> bool:
        """Whether the constraint allows `token_id` next, as `mask()[token_id]` says (no state changes; far
        cheaper than `mask`)."""
        if self._m.is_stopped():  # llguidance validates no token once stopped; the mask then holds EOS
            return token_id in self._eos
        return self._m.validate_tokens([token_id]) == 1

    def mask(self) -> torch.Tensor:
        """[vocab_size] bool: the tokens allowed next. A finished (or failed) matcher allows only EOS.

        Computed on the engine thread, when asked: a worker thread computing it during the model's forward
        slowed the whole batch on a CPU machine (GIL hand-offs at every op of the forward)."""
        self._m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        return unpack(self._words, self._vocab_size)

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
        self.vocab_size, self._eos = vocab_size, frozenset(eos_token_ids)
        self._tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._failed: OrderedDict[StructuredOutputs, str] = OrderedDict()  # spec -> why it failed
        self._lock = threading.Lock()

    def cached(self, spec: StructuredOutputs) -> llguidance.LLMatcher | None:
        """The compiled constraint if it is cached, None if it was never compiled; ValueError if it failed before
        (a repeat costs nothing)."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return template
            why = self._failed.get(spec)
        if why is not None:
            raise ValueError(why)
        return None

    def compile(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """The compiled constraint (a matcher never advanced: a template to copy). ValueError says what is wrong
        with the spec, now and on every repeat."""
        template = self.cached(spec)
        if template is not None:
            return template
        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as e:
            raise self.refuse(spec, f"{spec.field}: {e}") from e
        # llguidance releases the GIL while it compiles; its limits make a huge grammar fail instead of running on.
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            raise self.refuse(spec, f"{spec.field}: {template.get_error().splitlines()[0][:500]}")
        with self._lock:
            self._cache[spec] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return template

    def refuse(self, spec: StructuredOutputs, why: str) -> ValueError:
        """Remember that `spec` fails (least recently failed first out) and return the error to raise."""
        with self._lock:
            self._failed[spec] = why
            self._failed.move_to_end(spec)
            while len(self._failed) > FAILED_CACHE_SIZE:
                self._failed.popitem(last=False)
        return ValueError(why)

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one request (compiled now unless cached)."""
        return self.copy(self.compile(spec))

    def copy(self, template: llguidance.LLMatcher) -> GrammarMatcher:
        """A fresh matcher for one request: a copy of a compiled template (cheap)."""
        return GrammarMatcher(template.deep_copy(), self.vocab_size, self._eos)


_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)  # bit i of an int32 word


def unpack(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 words [W] -> bool [vocab_size]; bit i of word w is token 32*w+i."""
    return words.unsqueeze(1).bitwise_and(_BITS).ne(0).flatten()[:vocab_size]
