"""Constraints: one engine's structured output. The server-wide defaults filled into each request's spec, and the
grammar compiler for the model's vocabulary, made on the first constrained request (a model without a tokenizer
serves everything else)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hybridkv.structured.config import StructuredOutputsConfig
from hybridkv.structured.grammar import GrammarCompiler, GrammarMatcher
from hybridkv.structured.spec import StructuredOutputs


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

    def compile(self, spec: StructuredOutputs) -> None:
        """Compile (and cache) a request's constraint; ValueError names what is wrong with it."""
        self.compiler.compile(self.resolved(spec))

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one request (cheap once its constraint is compiled)."""
        return self.compiler.matcher(self.resolved(spec))

    def resolved(self, spec: StructuredOutputs) -> StructuredOutputs:
        """The spec with the server-wide defaults filled in (what the compiled-grammar cache is keyed by)."""
        if spec.disable_any_whitespace is None:
            return replace(spec, disable_any_whitespace=self.config.disable_any_whitespace)
        return spec
