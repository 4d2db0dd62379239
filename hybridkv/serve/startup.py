"""What `hybridkv serve` logs when it starts, as `vllm serve` does: version, device, the kernels chosen, the model,
the KV plan and its layout, the connectors, then where it listens. `startup_lines` builds the lines from a
constructed engine (no server needed); `cpu_info` is also what the tests print in their header."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridkv.kv.hashing import DEFAULT_HASH_ALGO
from hybridkv.kv.layout_names import vllm_layout_name
from hybridkv.kv.model_kv import load_hf_config
from hybridkv.models.fuse import FusedLinear
from hybridkv.models.loader import resolve_dtype
from hybridkv.models.packed_rows import PackedWeight, rows_kernel
from hybridkv.models.rope import apply_rope
from hybridkv.models.widened import ROWS_LIMIT, WidenedWeight
from hybridkv.native import KERNELS_ENV, native_enabled
from hybridkv.runner import kernels
from hybridkv.runner.states import steps_in_place
from hybridkv.units import format_bytes
from hybridkv.version import __version__

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.kv.plan import KVPlan

# The instruction-set flags that decide which kernel runs: AVX2 (generic vectors), AVX-512 (decode kernel),
# AVX512-BF16 (bf16 prefill and packed_rows), AMX-BF16 (oneDNN packs bf16 weights for AMX: packed_rows then keeps
# oneDNN), AVX512-FP16.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"


def cpu_info(cpuinfo: str | None = None) -> tuple[str, list[str]]:
    """This CPU's model name and which of CPU_FLAGS it has, read from /proc/cpuinfo (or the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return fields.get("model name", "unknown CPU"), [f for f in CPU_FLAGS if f in flags]


def cpu_line(cpuinfo: str | None = None) -> str:
    """'AMD EPYC (avx2 avx512f avx512_bf16; no amx_bf16 avx512_fp16)'."""
    name, have = cpu_info(cpuinfo)
    lacks = [f for f in CPU_FLAGS if f not in have]
    if not have:
        return f"{name} (none of {' '.join(CPU_FLAGS)})"
    return f"{name} ({' '.join(have)}{'; no ' + ' '.join(lacks) if lacks else ''})"


def device_line(device: torch.device) -> str:
    if device.type == "cuda":
        return f"device: CUDA {torch.cuda.get_device_name(device)} ({device})"
    isa = os.environ.get(ONEDNN_ISA_ENV)
    capped = f", {ONEDNN_ISA_ENV}={isa}" if isa else ""
    return f"device: CPU {cpu_line()}, torch capability {torch.backends.cpu.get_cpu_capability()}{capped}"


def linear_readers(model: nn.Module) -> list[object]:
    """What each projection of the model runs through once loaded (`Linear.packed`, `FusedLinear.packed`,
    `TiedLogits.packed`): oneDNN `PackedWeight`s, or another packer's weights (exact sums); none for plain ones."""
    found: dict[int, object] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            reader = value.packed if isinstance(value, FusedLinear) else value if name == "packed" else None
            if reader is not None:
                found[id(reader)] = reader
    return list(found.values())


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def state_steps(engine: LLMEngine) -> str:
    """How decode steps reach the recurrent states: in the pool, or gathered copies and why."""
    if engine.runner.state_kernel is not None:
        return "in the pool (native kernel; prefill chunks gathered)"
    if not native_enabled():
        why = "HYBRIDKV_KERNELS=torch"
    elif not engine.model.steps_states_in_place:
        why = "this model's recurrent layers step copies"
    elif engine.device.type != "cpu":
        why = "the native kernel is CPU-only"
    elif not steps_in_place(engine.plan.state):
        why = "the native kernel takes float32 or bfloat16 states"
    else:
        why = "the native kernel did not build: see the log"
    return f"gathered copies ({why})"


def fused_ops_used(model: nn.Module) -> dict[str, int]:
    """How many modules run each fused kernel (`models/fused.py`): RMSNorms, gated MLPs and attentions' RoPE."""
    hooked = [m for m in model.modules() if hasattr(m, "use_fused_ops")]
    used = {
        "rms_norm": sum(getattr(m, "kernel", None) is not None for m in hooked),
        "act_and_mul": sum(getattr(m, "act_and_mul", None) is not None for m in hooked),
        "rope": sum(getattr(m, "rope", apply_rope) is not apply_rope for m in hooked),
    }
    return {name: n for name, n in used.items() if n}


def kernel_lines(engine: LLMEngine) -> list[str]:
    """The attention kernels, how decodes step recurrent states, then the linears and fused ops the model runs."""
    states = [] if engine.plan.state is None else [f"state steps: {state_steps(engine)}"]
    if not native_enabled():
        return [f"kernels: {KERNELS_ENV}=torch: plain torch", *states]
    runner, model = engine.runner, engine.model
    bf16 = resolve_dtype(engine.config.dtype) == torch.bfloat16
    if runner.decode_kernel is not None:
        decode = "native"
    elif engine.device.type != "cpu":
        decode = "torch (not on CPU)"
    else:
        decode = "torch (the native kernel did not build: see the warning above, or the model and KV dtypes differ)"
    if runner.prefill_kernel is not None:
        prefill = f"native bf16 ({kernels.prefill_path()})"
    elif not bf16:
        prefill = f"torch (the native kernel is bfloat16; the model is {engine.config.dtype})"
    elif runner.decode_kernel is None:
        prefill = "torch (no native kernels)"
    elif any(v.shape[-1] % 32 for v in runner.memory.views.values()):
        prefill = "torch (the native kernel needs head sizes that are multiples of 32)"
    else:
        prefill = "torch (the native kernel needs AVX512-BF16)"
    invariant = runner.exact and engine.plan.state is None  # batch-invariant mode: exact arithmetic, exact steps
    exact = f"; exact steps in per-request tiles of {runner.query_tile} tokens" if runner.exact else ""
    lines = [f"attention kernels: decode {decode}, prefill {prefill}{exact}", *states]
    readers = linear_readers(model)
    packed = [r for r in readers if isinstance(r, PackedWeight)]
    widened = [r for r in readers if isinstance(r, WidenedWeight)]
    if invariant:
        lines.append(
            f"linears: batch-invariant, {_n(len(readers), 'projection')} and the norms and activations in exact "
            "arithmetic (no oneDNN packing, packed_rows or fused kernels)"
        )
    elif packed:
        trusted = sum(w.address is not None for w in packed)
        reader = rows_kernel().name if rows_kernel() is not None else "packed_rows"
        rows = (
            f"{reader} trusted for {trusted}, oneDNN kept by the probe for {len(packed) - trusted}"
            if bf16
            else f"{reader} unused (it reads bfloat16 weights only)"
        )
        fused = ", ".join(f"{name} in {_n(n, 'module')}" for name, n in fused_ops_used(model).items())
        lines.append(f"linears: {len(packed)} packed for oneDNN, {rows}; fused ops: {fused or 'none'}")
    elif widened:
        fused = ", ".join(f"{name} in {_n(n, 'module')}" for name, n in fused_ops_used(model).items())
        lines.append(
            f"linears: {_n(len(widened), 'bfloat16 weight')} widened to float32 (oneDNN has no bfloat16 path on "
            f"this CPU): up to {ROWS_LIMIT} rows widened_rows, more float32 MKL; fused ops: {fused or 'none'}"
        )
    elif engine.plan.state is not None and not bf16:
        lines.append("linears: exact sums (a row's bits do not depend on the rows beside it)")
    else:
        dtype, packs = engine.config.dtype, resolve_dtype(engine.config.dtype) in model.packed_dtypes
        why = f"{dtype} on {engine.device}" if packs else f"the model keeps plain matmuls in {dtype}"
        lines.append(f"linears: plain torch ({why})")
    return lines


def model_line(engine: LLMEngine, served_name: str | None = None) -> str:
    hf = load_hf_config(engine.config.model)
    model_type = hf.get("model_type", "?")
    served = f", served as {served_name!r}" if served_name else ""
    return (
        f"model: {engine.config.model} ({model_type}, {engine.config.dtype}, {engine.plan.num_layers} layers, "
        f"max_model_len {engine.max_model_len}{served})"
    )


def plan_lines(plan: KVPlan) -> list[str]:
    """The KV plan in two or three lines: groups and blocks, the recurrent state if any, the layout."""
    attention = [g for g in plan.groups if not g.is_state]
    kinds = ", ".join(
        f"{g.kind}{f' {g.sliding_window}' if g.sliding_window else ''}: {_n(len(g.layers), 'layer')}" for g in attention
    )
    shared = f"; {len(plan.shared)} layers share another's KV" if plan.shared else ""
    lines = [
        f"KV plan: {_n(len(attention), 'group')} ({kinds}{shared}), block size {plan.block_size}, "
        f"{plan.num_blocks} blocks x {format_bytes(plan.bytes_per_block)} = {format_bytes(plan.total_bytes)}; "
        f"max concurrency {plan.max_concurrency:.2f} at {plan.max_model_len} tokens"
    ]
    if plan.state is not None:
        st = plan.state
        lines.append(
            f"KV state: {len(st.slots)} recurrent layers, {format_bytes(st.blob_bytes)} per request, one group "
            f"(id {st.group}) of {st.num_pages}-page bundles ({format_bytes(st.bytes_per_request)} with padding); "
            f"prefills split at multiples of {st.align} tokens"
        )
    lines.append(
        f"KV layout: {plan.layout} ({_n(len(plan.buffer_sizes), 'buffer')}; vLLM's {vllm_layout_name(plan.layout)})"
    )
    return lines


def connectors_line(engine: LLMEngine) -> str:
    parts = []
    transfer = engine.config.kv_transfer_config
    if transfer is not None:
        where = "" if engine.connector is None else engine.connector.where()
        parts.append(f"{transfer.kv_connector} ({transfer.kv_role}{', ' + where if where else ''})")
    events = engine.config.kv_events_config
    if events is not None and events.enabled:
        parts.append(f"KV events on {events.endpoint}")
    return f"connectors: {', '.join(parts) or 'none'}"


def startup_lines(engine: LLMEngine, served_name: str | None = None) -> list[str]:
    """Everything but the address: version, device, kernels, model, KV plan, layout, connectors."""
    return [
        f"hybridkv {__version__} (torch {torch.__version__}, {_n(torch.get_num_threads(), 'CPU thread')})",
        device_line(engine.device),
        *kernel_lines(engine),
        model_line(engine, served_name),
        *plan_lines(engine.plan),
        hash_line(engine),
        connectors_line(engine),
    ]


def hash_line(engine: LLMEngine) -> str:
    algo = engine.config.prefix_caching_hash_algo
    if algo == DEFAULT_HASH_ALGO:
        return f"block hashes: {algo} (fixed root)"
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None:
        return (
            f"block hashes: {algo}, random root (PYTHONHASHSEED is not set): no router can recompute the ids "
            "KV events publish, and no other process shares this one's offloaded blocks; set PYTHONHASHSEED"
        )
    return f"block hashes: {algo}, root from PYTHONHASHSEED={seed} (as vLLM)"


def listening_line(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"listening on http://{shown}:{port}"


class _Stderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record arrives (a test runner may swap it)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: int = logging.INFO) -> None:
    """hybridkv's records at `level` and above to stderr, vLLM-style ('INFO 01-31 12:00:00 [name] message'); once."""
    root = logging.getLogger("hybridkv")
    root.setLevel(level)
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
