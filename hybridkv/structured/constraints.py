"""Constraints: one engine's structured output. The server-wide defaults filled into each request's spec, and the
grammar compiler for the model's vocabulary, made on the first constrained request (a model without a tokenizer
serves everything else)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridkv.structured.config import StructuredOutputsConfig
from hybridkv.structured.grammar import GrammarCompiler, GrammarMatcher
from hybridkv.structured.spec import StructuredOutputs


@dataclass(frozen=True)
class Compiled:
    """A compiled constraint (an llguidance matcher never advanced): what a request carries to the engine thread,
    which copies it and compiles nothing."""

    template: Any


class Constraints:
    """Thread-safe: the server compiles off its event loop (`compile`), the engine thread makes matchers."""

    def __init__(
        self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int], config: StructuredOutputsConfig
    ) -> None:
        self._model_dir, self._vocab_size, self._eos = model_dir, vocab_size, tuple(eos_token_ids)
        self.config = config
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """ValueError when the model has no tokenizer or no EOS token."""
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._model_dir, self._vocab_size, self._eos)
            return self._compiler

    def compile(self, spec: StructuredOutputs) -> Compiled:
        """Compile (and cache) a request's constraint; ValueError names what is wrong with it (also on a repeat of
        a spec that failed before)."""
        return Compiled(self.compiler.compile(self.resolved(spec)))

    def cached(self, spec: StructuredOutputs) -> Compiled | None:
        """The compiled constraint when the cache holds it (None: not compiled yet); ValueError if it failed."""
        if self._compiler is None:  # made by the first compile, on a compile thread (it loads the tokenizer)
            return None
        template = self.compiler.cached(self.resolved(spec))
        return None if template is None else Compiled(template)

    def refuse(self, spec: StructuredOutputs, why: str) -> ValueError:
        """Remember that `spec` failed (a compile past its time budget): a repeat is refused at once."""
        return self.compiler.refuse(self.resolved(spec), why)

    def matcher(self, spec: StructuredOutputs, compiled: Compiled | None = None) -> GrammarMatcher:
        """A fresh matcher for one request: a copy of `compiled`, else of the spec compiled now (offline use,
        where the caller's thread is the engine's)."""
        return self.compiler.copy((compiled or self.compile(spec)).template)

    def resolved(self, spec: StructuredOutputs) -> StructuredOutputs:
        """The spec with the server-wide defaults filled in (what the compiled-grammar cache is keyed by)."""
        if spec.disable_any_whitespace is None:
            return replace(spec, disable_any_whitespace=self.config.disable_any_whitespace)
        return spec
