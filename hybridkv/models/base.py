"""The one contract between models and the KV cache: models compute q/k/v, an AttentionFn does the rest.

Models are plain torch and know nothing of blocks. A forward pass runs over a flat batch of N tokens (several
requests packed back to back); the AttentionFn knows which request each token belongs to, where its KV lives
and which earlier tokens it may see (causal, plus the layer's sliding window).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from torch import nn


class AttentionFn(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [N, num_heads, head_size]
        kv: torch.Tensor | None,  # [N, 2, num_kv_heads, head_size] (keys, values); None for a KV-sharing consumer
        scale: float,
        sinks: torch.Tensor | None = None,  # [num_heads] float: a sink logit per head (GPT-OSS)
    ) -> torch.Tensor:  # [N, num_heads, head_size]
        """Store the keys and values of the N new tokens for `layer` (unless None), then attend each query to
        the KV its token may see: for a consumer, the KV its target layer stored. Returns the attention output.
        With `sinks`, head h's softmax denominator also holds exp(sinks[h]), an extra logit whose value row is
        zero: out_h = softmax-weighted values * Z_h / (Z_h + exp(sinks[h]))."""
        ...


class RecurrentStates(Protocol):
    """The recurrent state (Gated DeltaNet, Mamba2) of each request of a step, for the layers that keep one.

    Request r of the step owns the flat tokens `spans[r] = (t0, t1)`; spans are in flat order and cover [0, N).
    A recurrent layer runs each request's tokens through its scan separately (so a request's result never depends
    on the batch it shares a step with), starting from `state(layer, r)` and leaving the state after the request's
    last token in the same tensors, in place. A request whose first token is position 0 starts from zeros.
    Shapes (`kv.state` sizes them from the config; the layer must agree):
      conv       [K - 1, conv_dim]  the last K - 1 inputs of the causal conv, oldest first, token-major;
      recurrent  Gated DeltaNet [Hv, dk, dv]; Mamba2 [H, P, N].

    Requests listed in `in_place` (one token each) are stepped where their states live instead, batched, by a
    layer that declares `steps_states_in_place` (Gated DeltaNet): `conv_step` then `delta_step` per layer, giving
    the bits `causal_conv1d` and `gated_delta_step` give on the tensors `state` would return.
    """

    spans: Sequence[tuple[int, int]]
    in_place: Sequence[int]  # request indices, ascending; never asked for through `state`

    def state(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) state of request r for `layer`, to read and overwrite in place."""
        ...

    def conv_step(self, layer: int, x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """The causal conv of the `in_place` requests' tokens x [n, conv_dim] with taps [K, conv_dim] (float32),
        moving their conv windows on; returns [n, conv_dim] in x's dtype."""
        ...

    def delta_step(self, layer: int, *inputs: torch.Tensor) -> torch.Tensor:
        """`gated_delta_step` on the `in_place` requests' recurrent states with `step_inputs`' tensors
        (q, k, v, decay, beta; n rows); returns the outputs [n, Hv, dv] float32."""
        ...


@dataclass(frozen=True)
class OutputRows:
    """The rows of a step whose hidden states are used (the last token of each chunk that samples), and an
    AttentionFn over exactly those rows, one query each at its own position. Layers that write no KV (KV-sharing
    consumers) need to run for these rows only: what they compute for any other row feeds nothing."""

    rows: torch.Tensor  # [M] indices into the step's N tokens
    attn: AttentionFn  # queries [M]: row i of a call is the token at rows[i]


class CausalLM(nn.Module):
    """A decoder-only model over a flat token batch."""

    # The dtypes in which its `linear.Linear` and `FusedLinear` projections run through packed oneDNN weights
    # (`linear.py`). Recurrent hybrids leave float32 out: there they promise row-count-independent bits.
    packed_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()
    # Its projections, norms and activations can switch to exact arithmetic (`batch_invariant.py`), so that with
    # the runner's exact steps every mode gives a request's single-run bits. Recurrent hybrids are exact always.
    batch_invariant: ClassVar[bool] = False
    # forward takes `outputs: OutputRows` and returns hidden states for those rows only ([M, hidden]).
    narrows_outputs: ClassVar[bool] = False
    # Every recurrent layer steps `RecurrentStates.in_place` requests through `conv_step` / `delta_step`; the
    # runner lists requests there only for such models.
    steps_states_in_place: ClassVar[bool] = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionFn,
        states: RecurrentStates | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [N] (positions restart at each request's offset). Returns hidden [N, hidden].
        `states` is given exactly when the model has recurrent layers."""
        raise NotImplementedError

    def state_shapes(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """Recurrent layer -> (conv shape, recurrent shape) the layer reads from `RecurrentStates`; the engine
        checks them against the plan's (read from the config separately). Attention-only models: none."""
        return {}

    def fuse_projections(self) -> None:
        """Optional: merge projections that read the same input (q/k/v, gate/up) into one matmul each.
        Called once after the weights are loaded; the default does nothing."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, hidden] -> [M, vocab] (final norm already applied by forward; softcapping etc. applied here)."""
        raise NotImplementedError


def bind_attributes(model: nn.Module) -> None:
    """Copy every module's submodules and parameters into its instance `__dict__`, so that `self.mlp` in a
    forward is a plain attribute read instead of a call to `nn.Module.__getattr__` (about 200 per decode step,
    ~8% of a step on the benchmark model). Call once the weights are final: assignments through `setattr` drop
    the copy again, but code that swaps entries of `_parameters` directly would leave it stale."""
    for module in model.modules():
        module.__dict__.update(module._modules)
        module.__dict__.update(module._parameters)


def embedding(num: int, dim: int) -> nn.Embedding:
    """An `nn.Embedding` whose [num, dim] table is allocated on the current default device (meta, while
    `build_model` builds) but not initialised: the checkpoint fills it. nn.Embedding's own random init on the meta
    device goes through torch._refs, which imports torch._dynamo: ~1.8 s of every server's start-up."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
