"""What `hybridkv serve` says when it starts (`serve/startup.py`): version, device, the kernels chosen, the model,
the KV plan, layout and connectors, then where it listens. The lines are checked against what the engine actually
chose (recorded independently where the summary could miscount), then once through a real server's log."""

import re

import pytest
import torch

from hybridkv.engine.config import DEFAULT_MODEL_DIR, EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.models import packed_rows, registry
from hybridkv.runner import kernels
from hybridkv.serve.startup import CPU_FLAGS, cpu_info, cpu_line, listening_line, startup_lines
from hybridkv.units import format_bytes
from hybridkv.version import __version__
from tests.procs import Process
from tests.tiny_models import build

INTEL = (
    "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
    "flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16\n\n"
    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: fpu\n"
)
AMD = "processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: fpu avx2 avx512f avx512_bf16 vnni\n"
GDN_MODEL = DEFAULT_MODEL_DIR.parent / "gdn-model"


def test_cpu_model_and_flags_come_from_cpuinfo():
    assert cpu_info(INTEL) == ("Intel(R) Xeon(R) Platinum 8488C", list(CPU_FLAGS))  # the first processor's
    assert cpu_info(AMD) == ("AMD EPYC 9R14 96-Core Processor", ["avx2", "avx512f", "avx512_bf16"])
    assert cpu_line(AMD) == "AMD EPYC 9R14 96-Core Processor (avx2 avx512f avx512_bf16; no amx_bf16 avx512_fp16)"
    assert cpu_info("model name: X\nflags: avx512_fp16 avx512fx") == ("X", ["avx512_fp16"])  # whole flags only
    assert cpu_line("") == f"unknown CPU (none of {' '.join(CPU_FLAGS)})"
    assert listening_line("::1", 8000) == "listening on http://[::1]:8000"


def recording_engine(monkeypatch, **config) -> tuple[LLMEngine, dict[str, list]]:
    """An engine, with what its load did recorded apart from the summary: oneDNN packings, fused-op hooks, and
    each bf16 weight's probe verdict."""
    seen: dict[str, list] = {"packed": [], "fused": [], "verdicts": []}

    def record(key, real):
        return lambda *a: seen[key].append(real(*a)) or seen[key][-1]

    monkeypatch.setattr(registry, "pack_linears", record("packed", registry.pack_linears))
    monkeypatch.setattr(registry, "use_fused_ops", record("fused", registry.use_fused_ops))
    monkeypatch.setattr(packed_rows, "kernel_matches_onednn", record("verdicts", packed_rows.kernel_matches_onednn))
    return LLMEngine(EngineConfig(**config)), seen


def test_lines_say_what_a_float32_engine_chose(tiny_gemma4, monkeypatch):
    monkeypatch.delenv("HYBRIDKV_KERNELS", raising=False)
    engine, seen = recording_engine(
        monkeypatch, model=str(tiny_gemma4), kv_cache_memory="16MiB", max_model_len=256, kv_offload_cpu="16MiB"
    )
    try:
        lines = startup_lines(engine, "tiny")
    finally:
        engine.shutdown()
    threads = torch.get_num_threads()
    assert lines[0] == f"hybridkv {__version__} (torch {torch.__version__}, {threads} CPU thread{'s' * (threads > 1)})"
    assert lines[1].startswith(f"device: CPU {cpu_line()}, torch capability {torch.backends.cpu.get_cpu_capability()}")
    decode = "native" if engine.runner.decode_kernel is not None else "torch"
    assert lines[2].startswith(f"attention kernels: decode {decode}, prefill torch (the native kernel is bfloat16")
    assert not seen["verdicts"], "float32 weights are never probed"
    if engine.runner.exact:  # batch-invariant float32: nothing packed for oneDNN
        assert not seen["packed"] and lines[3].startswith("linears: batch-invariant, ")
    else:
        (packed,), (hooks,) = seen["packed"], seen["fused"]
        assert lines[3].startswith(f"linears: {packed} packed for oneDNN, packed_rows unused")
        fused = [int(n) for n in re.findall(r"(?:rms_norm|act_and_mul) in (\d+) module", lines[3])]
        assert sum(fused) == hooks
    assert lines[4] == f"model: {tiny_gemma4} (gemma4_text, float32, 8 layers, max_model_len 256, served as 'tiny')"
    plan = engine.plan
    groups = "2 groups (full_attention: 2 layers, sliding_window 16: 3 layers; 3 layers share another's KV)"
    assert lines[5].startswith(f"KV plan: {groups}, ")
    assert (
        f"block size 16, {plan.num_blocks} blocks x {format_bytes(plan.bytes_per_block)} = "
        f"{format_bytes(plan.total_bytes)}; max concurrency {plan.max_concurrency:.2f} at 256 tokens"
    ) in lines[5]
    buffers = f"{len(plan.buffer_sizes)} buffer{'s' * (len(plan.buffer_sizes) > 1)}"
    assert lines[6] == f"KV layout: {plan.layout} ({buffers}; vLLM's {'BLNHC' if plan.layout == 'packed' else 'LBNHC'})"
    assert lines[7] == "block hashes: hybridkv (fixed root)"
    assert lines[8] == "connectors: OffloadingConnector (kv_both)"
    assert len(lines) == 9


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN packs no bf16 weights on this CPU: they are widened (tests/models/test_widened.py)",
)
@pytest.mark.parametrize("probe", ["this CPU's", "forced to keep oneDNN"])
def test_bfloat16_lines_count_what_the_probe_trusted(tmp_path, monkeypatch, probe):
    """packed_rows is trusted weight by weight by the load-time probe; the line says how many each way."""
    monkeypatch.delenv("HYBRIDKV_KERNELS", raising=False)
    if probe != "this CPU's":
        monkeypatch.setattr(packed_rows, "kernel_matches_onednn", lambda n, k: False)
    folder = build("qwen3", tmp_path / "m", head_dim=32, hidden_size=128, intermediate_size=1100)
    engine, seen = recording_engine(monkeypatch, model=str(folder), dtype="bfloat16", kv_cache_memory="16MiB")
    lines = startup_lines(engine)
    verdicts = seen["verdicts"]
    assert verdicts and len(verdicts) == seen["packed"][0], "one probe verdict per packed bf16 weight"
    trusted = sum(verdicts)
    reader = packed_rows.rows_kernel().name if packed_rows.rows_kernel() else "packed_rows"
    assert f"{reader} trusted for {trusted}, oneDNN kept by the probe for {len(verdicts) - trusted};" in lines[3]
    if probe != "this CPU's":
        assert trusted == 0
    prefill = (
        f"native bf16 ({kernels.prefill_path()})" if engine.runner.prefill_kernel else "torch (the native kernel needs"
    )
    assert lines[2].startswith(f"attention kernels: decode native, prefill {prefill}")


def test_plain_torch_and_recurrent_state(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_KERNELS", "torch")
    engine = LLMEngine(EngineConfig(model=str(GDN_MODEL), kv_cache_memory="16MiB"))
    lines = startup_lines(engine)
    assert lines[2] == "kernels: HYBRIDKV_KERNELS=torch: plain torch"
    assert not any(line.startswith(("attention kernels", "linears")) for line in lines)
    st = engine.plan.state
    (state,) = [line for line in lines if line.startswith("KV state:")]
    assert state.startswith(
        f"KV state: {len(st.slots)} recurrent layers, {format_bytes(st.blob_bytes)} per request, one group "
        f"(id {st.group}) of {st.num_pages}-page bundles ({format_bytes(st.bytes_per_request)} with padding); "
        f"prefills split at multiples of {st.align}"
    )
    assert "state steps: gathered copies (HYBRIDKV_KERNELS=torch)" in lines
    assert "(qwen3_5_text, float32, 4 layers" in lines[4] and lines[-1] == "connectors: none"
    monkeypatch.setenv("HYBRIDKV_KERNELS", "native")
    native = startup_lines(LLMEngine(EngineConfig(model=str(GDN_MODEL), kv_cache_memory="16MiB")))
    assert native[2].endswith(f"; exact steps in per-request tiles of {st.align} tokens")
    assert native[3] == "state steps: in the pool (native kernel; prefill chunks gathered)"
    assert native[4] == "linears: exact sums (a row's bits do not depend on the rows beside it)"


def test_a_server_logs_each_line_before_it_is_healthy(tiny_gemma4):
    server = Process(
        "serve", "--model", str(tiny_gemma4), "--served-model-name", "tiny", "--kv-cache-memory", "16MiB",
        "--max-model-len", "256", "--threads", "1", "--kv-offload-cpu", "16MiB",
    )  # fmt: skip
    try:
        log = server.log.read_text()  # healthy now: everything below was printed before /health answered
    finally:
        server.stop()
    ours = [line.split("[hybridkv.serve] ", 1)[1] for line in log.splitlines() if "[hybridkv.serve] " in line]
    expected = [
        f"hybridkv {__version__} (torch {torch.__version__}, 1 CPU thread)",
        f"device: CPU {cpu_line()}, torch capability ",
        "attention kernels: decode ",
        "linears: ",
        f"model: {tiny_gemma4} (gemma4_text, float32, 8 layers, max_model_len 256, served as 'tiny')",
        "KV plan: 2 groups (",
        "KV layout: ",
        "block hashes: hybridkv (fixed root)",
        "connectors: OffloadingConnector (kv_both)",
        "requests: bodies up to 1048576 bytes; prompt texts over 1275 characters are refused before tokenizing",
        f"listening on http://127.0.0.1:{server.port}",
    ]
    assert len(ours) == len(expected), log
    for line, start in zip(ours, expected):
        assert line.startswith(start), (line, start)
    first = next(line for line in log.splitlines() if "[hybridkv.serve] " in line)
    assert re.fullmatch(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[hybridkv\.serve\] hybridkv .+", first), first  # vLLM's shape
