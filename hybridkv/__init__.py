"""hybridkv: a small LLM-serving engine whose core is a KV cache system for hybrid models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridkv.version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "__version__"]

if TYPE_CHECKING:
    from hybridkv.engine.llm import LLM
    from hybridkv.request.sampling_params import SamplingParams
    from hybridkv.structured.spec import StructuredOutputs


def __getattr__(name: str) -> Any:
    # Lazy, so `hybridkv plan` and the KV core never pay for importing the engine.
    if name == "LLM":
        from hybridkv.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hybridkv.request.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from hybridkv.structured.spec import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(name)
