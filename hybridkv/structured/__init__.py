"""Structured output: a request's output constrained by a JSON schema, a regex, a choice or a grammar.

- `spec`: what a request asks for (`StructuredOutputs`, `KINDS`), plain data, no torch;
- `grammar`: compiling it (`GrammarCompiler`) and following it token by token (`GrammarMatcher`);
- `constraints`: the engine's cache of compiled grammars and its per-request matchers.
"""
