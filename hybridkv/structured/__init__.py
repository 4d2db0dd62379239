"""Structured output: a request's output constrained by a JSON schema, a regex, a choice or a grammar."""

from hybridkv.structured.grammar import GrammarCompiler, GrammarMatcher
from hybridkv.structured.spec import KINDS, StructuredOutputs

__all__ = ["KINDS", "GrammarCompiler", "GrammarMatcher", "StructuredOutputs"]
