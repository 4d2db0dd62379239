"""Layout names: ours (`auto`, `per-layer`, `packed`) and vLLM's KVCacheLayout spellings of the two we have."""

from __future__ import annotations

KV_LAYOUTS = ("auto", "per-layer", "packed")

# vLLM's KVCacheLayout names (RFC #42082): the logical axes are [L, B, H, N, C] (layers, blocks, kv heads, tokens of
# a block, content) and a name spells their physical order. Within a layer ours keep a block's tokens outermost and
# each token's content together (K then V, each [H, D]), so tokens come before heads (N before H):
#
#     per_layer   layer -> block -> token -> (K|V, head, dim)      LBNHC
#     packed      block -> layer -> token -> (K|V, head, dim)      BLNHC
#
# The head-major orders (LBHNC, LHBNC, BLHNC, BHLNC: a head's tokens contiguous) are not ours.
VLLM_LAYOUT_NAMES = {"LBNHC": "per_layer", "BLNHC": "packed"}
HEAD_MAJOR_LAYOUTS = ("LBHNC", "LHBNC", "BLHNC", "BHLNC")


def normalize_layout(requested: str) -> str:
    """`requested` as one of KV_LAYOUTS: vLLM's names for our two layouts are accepted; a ValueError otherwise."""
    name = requested.upper() if isinstance(requested, str) else requested
    if name in VLLM_LAYOUT_NAMES:
        return VLLM_LAYOUT_NAMES[name].replace("_", "-")
    if name in HEAD_MAJOR_LAYOUTS:
        raise ValueError(
            f"kv_layout {requested}: a head-major layout (a head's tokens contiguous), which hybridkv does not "
            f"have; its layouts are LBNHC (per-layer) and BLNHC (packed)"
        )
    if requested not in KV_LAYOUTS:
        names = ", ".join([*KV_LAYOUTS, *VLLM_LAYOUT_NAMES])
        raise ValueError(f"kv_layout must be one of {names}, got {requested!r}")
    return requested


def vllm_layout_name(layout: str) -> str:
    """The vLLM KVCacheLayout name of one of our layouts ("per_layer" or "packed")."""
    return next(name for name, ours in VLLM_LAYOUT_NAMES.items() if ours == layout)
