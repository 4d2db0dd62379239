"""CompilePool: structured-output constraints compile on threads of their own, with a time budget each, so that no
grammar delays a request without one (compiles used to share the request thread pool: six 50k-choice lists made
an unconstrained request wait 65-115 s).

    request --cached?--yes--> Compiled (or the cached failure: 400 at once)
               |no
               v
    pending < MAX_PENDING_COMPILES? --no--> 503 (retry later)
               |yes
               v
    COMPILE_WORKERS threads --> Compiled | ValueError (400, cached)
                            --> still compiling COMPILE_TIMEOUT_S after it started: 400, cached as failed

A compile past its budget cannot be stopped (llguidance runs it in native code); it finishes on its worker, which
stays counted as pending until then, so timed-out compiles cannot pile up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

from hybridkv.structured.constraints import Compiled, Constraints
from hybridkv.structured.limits import COMPILE_TIMEOUT_S, COMPILE_WORKERS, MAX_PENDING_COMPILES
from hybridkv.structured.spec import StructuredOutputs

POLL_S = 0.1  # how often a waiting request checks whether its compile has run past its budget


class CompileBusy(Exception):
    """Too many constraints are compiling: retry later."""


class CompilePool:
    def __init__(
        self,
        constraints: Constraints,
        workers: int = COMPILE_WORKERS,
        max_pending: int = MAX_PENDING_COMPILES,
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._constraints, self._max_pending, self._timeout_s = constraints, max_pending, timeout_s
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self.pending = 0  # submitted and not finished (event loop only)
        # The compiler loads the tokenizer into llguidance (holding the GIL: ~0.2 s stalled /health when the first
        # constrained request paid for it): done now, in the background.
        self._executor.submit(self._warm)

    def _warm(self) -> None:
        with contextlib.suppress(ValueError):  # no tokenizer or no EOS: each constrained request is told so
            _ = self._constraints.compiler

    async def compile(self, spec: StructuredOutputs) -> Compiled:
        """The compiled constraint. ValueError: what is wrong with it (also at once for a spec that failed
        before); CompileBusy: MAX_PENDING_COMPILES are in flight."""
        cached = self._constraints.cached(spec)
        if cached is not None:
            return cached
        if self.pending >= self._max_pending:
            raise CompileBusy(f"{self.pending} structured-output constraints are compiling: retry later")
        started: list[float] = []

        def work() -> Compiled:
            started.append(time.monotonic())
            return self._constraints.compile(spec)

        self.pending += 1
        future = asyncio.wrap_future(self._executor.submit(work))
        future.add_done_callback(self._done)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(future), POLL_S)
            except TimeoutError:
                if started and time.monotonic() - started[0] > self._timeout_s:
                    raise self._constraints.refuse(
                        spec, f"{spec.field}: did not compile within {self._timeout_s:g} s: simplify the constraint"
                    ) from None

    def _done(self, future: asyncio.Future) -> None:
        self.pending -= 1
        if not future.cancelled():
            future.exception()  # retrieved: a timed-out compile's error is not "never retrieved"

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
