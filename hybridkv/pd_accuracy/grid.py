"""The sweep's axes and options, and its cells: which instances each cell runs and in which layouts."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

MODELS = ("embedded", "gemma4-k-eq-v")
# layout name -> (prefill instances' --kv-layout, decode instances' --kv-layout)
LAYOUTS: dict[str, tuple[str, str]] = {
    "per-layer": ("per-layer", "per-layer"),
    "packed": ("packed", "packed"),
    "mixed": ("per-layer", "packed"),
    "mixed-reverse": ("packed", "per-layer"),
}
TOPOLOGIES: dict[str, tuple[int, int]] = {"1P1D": (1, 1), "2P1D": (2, 1), "1P2D": (1, 2)}  # (prefill, decode)
ROUTERS = ("proxy", "vllm-router")


@dataclass(frozen=True)
class SweepOptions:
    """What the sweep runs: the axes' selected values and the per-cell workload."""

    models: tuple[str, ...] = MODELS
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    topologies: tuple[str, ...] = tuple(TOPOLOGIES)
    routers: tuple[str, ...] = ROUTERS
    limit: int | None = 16  # lm-eval items (the first ones of the held-out file); None: all
    num_fewshot: int = 0
    chat: bool = False
    num_prompts: int = 8  # greedy prompts per cell
    max_tokens: int = 12  # greedy tokens per prompt (EOS ignored)
    num_concurrent: int = 8  # lm-eval's concurrent requests
    kv_cache_memory: str = "64MiB"
    max_model_len: int | None = None
    start_timeout: float = 600  # seconds an instance or router may take to answer /health (busy machines: minutes)

    def __post_init__(self) -> None:
        for axis, chosen, known in (
            ("model", self.models, MODELS),
            ("layout", self.layouts, tuple(LAYOUTS)),
            ("topology", self.topologies, tuple(TOPOLOGIES)),
            ("router", self.routers, ROUTERS),
        ):
            unknown = [c for c in chosen if c not in known]
            if unknown or not chosen:
                raise ValueError(
                    f"unknown {axis} {', '.join(unknown) or '(none chosen)'}; choose from {', '.join(known)}"
                )
        if self.num_prompts < 1 or self.max_tokens < 1 or (self.limit is not None and self.limit < 1):
            raise ValueError("--num-prompts, --max-tokens and --limit must be positive")
        if self.num_fewshot < 0:
            raise ValueError("--num-fewshot must be 0 or more")


@dataclass(frozen=True)
class Cell:
    """One sweep cell: a model, its instances' layouts and counts, and the router in front."""

    model: str
    layout: str
    topology: str
    router: str

    @property
    def prefill_layouts(self) -> tuple[str, ...]:
        return (LAYOUTS[self.layout][0],) * TOPOLOGIES[self.topology][0]

    @property
    def decode_layouts(self) -> tuple[str, ...]:
        return (LAYOUTS[self.layout][1],) * TOPOLOGIES[self.topology][1]

    @property
    def instances(self) -> tuple[str, str, str]:
        """What shares the same instances: cells that differ only in the router reuse them."""
        return self.model, self.layout, self.topology


def cells(options: SweepOptions) -> list[Cell]:
    """Every selected cell, model-major, the routers of one set of instances next to each other."""
    axes = (options.models, options.layouts, options.topologies, options.routers)
    return [Cell(*values) for values in product(*axes)]
