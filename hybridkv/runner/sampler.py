"""Sampler: penalties and logit_bias, then greedy, temperature, top-k, top-p, with a per-request seed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from hybridkv.models.fused import fused_ops
from hybridkv.request.outputs import TokenLogprob
from hybridkv.request.sampling_params import SamplingParams

TOP_CANDIDATES = 8  # a greedy constrained row tries its best few tokens before it builds the full mask


class TokenConstraint(Protocol):
    """What a constrained row (structured output) may pick next: `allows` checks one token cheaply, `mask` lists
    them all. Neither changes the constraint's state."""

    def allows(self, token_id: int) -> bool: ...

    def mask(self) -> torch.Tensor: ...  # [vocab] bool, never all False


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    banned: Sequence[Sequence[int]] = (),
    history: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
    errors: dict[int, str] | None = None,
    constraints: Mapping[int, TokenConstraint] | None = None,
) -> list[int]:
    """logits: [M, vocab]. `banned[i]` are token ids row i may not pick (EOS before min_tokens); `history[i]`:
    row i's (prompt, output) token ids, needed only by rows with penalties. `constraints[i]`: what row i may pick
    (structured output); other rows are left as they are, bit for bit. With `errors`, a row whose sampling raises
    is recorded there (row -> reason) and the others go on unchanged (each has its own generator).

    A constrained row builds its mask only when a cheaper exact way fails (`_constrained`): greedy, when none of
    its best few tokens settles the choice; at a temperature alone, when a draw from the whole row is forbidden.
    With top-k or top-p it is masked first."""
    if not any(banned) and not constraints and all(p.greedy and not p.penalized and not p.logit_bias for p in params):
        return greedy(logits)
    logits = logits.float()
    if any(banned) or any(p.penalized or p.logit_bias for p in params):
        logits = logits.clone()  # the caller's logits stay raw (logprobs read them), and may be inference tensors
    for i, p in enumerate(params):
        if p.penalized:
            logits[i] = _guarded(errors, i, logits[i], penalize, logits[i], p, *history[i])
        if p.logit_bias:  # OpenAI's logit_bias: added to the logits, before everything that picks
            ids, biases = zip(*p.logit_bias)
            logits[i, list(ids)] += torch.tensor(biases)
    for i, ids in enumerate(banned):
        if ids:
            logits[i, list(ids)] = float("-inf")
    if any(p.penalized for p in params):
        logits = finite(logits)  # a tiny repetition penalty divides a logit into inf
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if errors is not None and i in errors:
            continue
        if constraints and i in constraints:
            ban = bool(banned and banned[i])
            out[i] = _guarded(errors, i, out[i], _constrained, logits[i], out[i], p, generators[i], constraints[i], ban)
        elif not p.greedy:
            out[i] = _guarded(errors, i, out[i], _draw, logits[i], p, generators[i])
    return out


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as `logits.float().argmax(-1)` gives it (the first largest; a NaN row its first NaN):
    read in place by the native kernel on CPU, which skips the float32 copy of a [M, vocab] batch (a bfloat16
    batch of 16 x 248k logits: ~0.6 ms against ~3.7 ms); torch's argmax elsewhere."""
    ops = fused_ops() if logits.device.type == "cpu" and logits.dim() == 2 and logits.size(0) > 0 else None
    if ops is not None and logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1:
        return ops.row_argmax(logits).tolist()
    return logits.float().argmax(dim=-1).tolist()


def _constrained(
    row: torch.Tensor,
    argmax: int,
    p: SamplingParams,
    generator: torch.Generator | None,
    constraint: TokenConstraint,
    banned: bool,
) -> int:
    """One constrained row's token, `row`'s `argmax` given. Without the mask where that is exact: greedy, one of
    the best few tokens (`_best_allowed`); at a temperature alone, a draw from the whole row kept when allowed
    (P(t) = p(t) + (1 - Z) p(t) / Z = p(t) / Z for an allowed t, Z the allowed mass: the masked distribution).
    Else from the masked row; ValueError when nothing is left there (only possible with `banned` tokens: the
    constraint allows only EOS before min_tokens, or stop_token_ids). A mask itself is never empty."""
    if p.greedy:
        best = _best_allowed(row, argmax, constraint)
    elif p.top_k <= 0 and p.top_p >= 1.0:
        token = _draw(row, p, generator)
        best = token if constraint.allows(token) else None
    else:  # top-k / top-p keep the best *allowed* tokens: only the mask shows which
        best = None
    if best is not None:
        return best
    row = torch.where(constraint.mask(), row, float("-inf"))
    if banned and not bool((row > float("-inf")).any()):
        raise ValueError("no token satisfies both the structured-output constraint and min_tokens / stop_token_ids")
    return int(row.argmax()) if p.greedy else _draw(row, p, generator)


def _best_allowed(row: torch.Tensor, argmax: int, constraint: TokenConstraint) -> int | None:
    """The argmax of `row` masked by `constraint`, found without the mask, or None. The masked argmax is the first
    index of the largest allowed value: the row's own `argmax` when allowed; else, in the row's top candidates
    (descending), the first allowed one whose value no later candidate ties (a tie could hide an allowed token
    with a lower index; the tokens before it are all forbidden). None when no candidate settles it."""
    if constraint.allows(argmax):
        return argmax
    values, ids = row.topk(min(TOP_CANDIDATES, row.numel()))
    values, ids = values.tolist(), ids.tolist()
    for j in range(len(ids) - 1):
        if ids[j] != argmax and constraint.allows(ids[j]):
            return ids[j] if values[j + 1] < values[j] else None
    return None


def _draw(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """One row: temperature, top-k, top-p, then a draw from what is left."""
    row = finite(logits / p.temperature)
    if p.top_k > 0:
        kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < p.top_p  # the smallest set reaching top_p
        keep[0] = True  # at least one token, also where top_p rounds to 0 in float32
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


T = TypeVar("T")


def _guarded(errors: dict[int, str] | None, row: int, fallback: T, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`; with `errors` given, a failure records why row `row` failed and returns `fallback`."""
    if errors is None:
        return work(*args)
    try:
        return work(*args)
    except Exception as e:  # this row's values broke something: fail its request, not the batch
        errors[row] = f"sampling failed: {type(e).__name__}: {e}"
        return fallback


def finite(x: torch.Tensor) -> torch.Tensor:
    """+inf becomes the largest float and nan -inf; -inf (a banned token) stays. Softmax stays defined."""
    return torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)


def penalize(row: torch.Tensor, p: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
    """vLLM's order: the repetition penalty on every token seen (prompt or output), then frequency and presence
    penalties on the output's tokens. row: [vocab] float32 logits."""
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.zeros_like(row, dtype=torch.bool)
        seen[torch.tensor([*prompt, *output], device=row.device)] = True
        scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row = torch.where(seen, scaled, row)
    if output and (p.frequency_penalty or p.presence_penalty):
        ids = torch.tensor(output, device=row.device)
        counts = torch.zeros_like(row).scatter_add_(0, ids, torch.ones(len(output), device=row.device))
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    return row


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """logits [M, vocab] (before temperature or bans), the M sampled tokens, how many alternatives per row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    k = max(top, default=0)
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [TokenLogprob(t, c, tuple(zip(i[:n], v[:n]))) for t, c, i, v, n in zip(tokens, chosen, ids, values, top)]
