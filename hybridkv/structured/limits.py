"""How large and how slow one structured-output constraint may be. A constraint past a size cap is refused before
it compiles; one that compiles past COMPILE_TIMEOUT_S is refused (and remembered, so a repeat is refused at once).

Measured on the embedded model's tokenizer (AMD EPYC, one thread): 4096 choices compile in 27 ms, 16k in 0.19 s,
45k in 1.2 s (superlinear); the 45k-60k string lists that starved a server took 65-115 s each, six at once.
"""

from __future__ import annotations

import llguidance

MAX_SPEC_BYTES = 128 << 10  # a schema, regex, grammar or choice list, as UTF-8 text
MAX_CHOICES = 1024  # each is one item of a parser row; llguidance fails a row past 2000 at the first token
MAX_SCHEMA_DEPTH = 32  # nesting of a JSON schema given as text (a body's JSON is held to the same depth)
COMPILE_TIMEOUT_S = 10.0
COMPILE_WORKERS = 1  # compiles run here, never on the request pool or the engine thread
MAX_PENDING_COMPILES = 8  # waiting for a worker; more are refused (503) until one is done
FAILED_CACHE_SIZE = 256  # specs that failed, refused at once on a repeat

# llguidance's own budgets, below its defaults: a grammar past them fails fast instead of compiling for minutes.
# verbose_errors off: an error names the problem, not the parser's state (which would echo the grammar to the client).
PARSER_LIMITS = dict(
    max_grammar_size=200_000, max_lexer_states=50_000, initial_lexer_fuel=1_000_000, verbose_errors=False
)


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**PARSER_LIMITS)


def json_depth(value: object) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest
