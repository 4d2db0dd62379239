"""An obviously correct `RecurrentStates` for one sequence: one conv and one recurrent tensor per layer, kept
across forward passes. The oracle the runner's paged states are tested against, and what model tests drive."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hybridkv.models.state_store import Int8Rows

Shape = tuple[int, ...]


class ReferenceStates:
    """Call the model with it for every forward pass of one sequence, whose tokens arrive in order; `spans` is
    set to the pass's one request before each call (`for_tokens`)."""

    def __init__(
        self,
        shapes: Mapping[int, tuple[Shape, Shape]],  # layer -> (conv shape, recurrent shape)
        conv_dtype: torch.dtype = torch.float32,
        ssm_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.conv = {layer: torch.zeros(c, dtype=conv_dtype, device=device) for layer, (c, _) in shapes.items()}
        self.ssm: dict[int, torch.Tensor | Int8Rows] = {}
        for layer, (_, s) in shapes.items():
            if ssm_dtype == torch.int8:  # quantized rows (`state_store`)
                zeros = torch.zeros(s, dtype=torch.int8, device=device)
                self.ssm[layer] = Int8Rows(zeros, torch.zeros(s[:-1], dtype=torch.float32, device=device))
            else:
                self.ssm[layer] = torch.zeros(s, dtype=ssm_dtype, device=device)
        self.spans: list[tuple[int, int]] = []
        self.in_place: tuple[int, ...] = ()  # every state is a tensor here: no request is stepped in the pool

    def for_tokens(self, n: int) -> ReferenceStates:
        self.spans = [(0, n)]
        return self

    def state(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor | Int8Rows]:
        if r != 0:
            raise ValueError(f"ReferenceStates holds one sequence, asked for request {r}")
        return self.conv[layer], self.ssm[layer]
