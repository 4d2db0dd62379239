"""Per-step bookkeeping of a decoding batch with the model forward stubbed out: the engine's whole step (schedule,
block tables, runner metadata, the recurrent states' step view, sampling, update) minus any model work, per
decoding request, for a recurrent hybrid against an attention-only model, side by side in one run.

    python benchmarks/bench_bookkeeping.py [--batch 64] [--prompt 256] [--steps 40] [--threads 1] [--json]

Models (configs only, no weights: the stub returns zeros):
  qwen3.5-0.8b        examples/configs/qwen3.5-0.8b.json, float32 recurrent state (18.7 MiB per request)
  qwen3.5-0.8b-bf16   the same with a bfloat16 recurrent state (half the bytes: bookkeeping must not change)
  gemma-3-270m        attention only: 18 layers, 1 KV head of 256, sliding window 512 every 6th layer full

The issue's figure before this change: 2.4-2.7 ms per decoding request per step at 201 state page groups, against
28-35 us for Gemma-3-270M. The target: the hybrid within 1.5x of the attention-only model, fp32 and bf16 state
within noise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
GEMMA_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "sliding_window": 512, "layer_types": [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
    ], "max_position_embeddings": 32768, "vocab_size": 262144, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "torch_dtype": "bfloat16",
}  # fmt: skip


def configs() -> dict[str, dict]:
    qwen = json.loads((ROOT / "examples/configs/qwen3.5-0.8b.json").read_text())
    text = qwen.get("text_config", qwen)
    bf16 = json.loads(json.dumps(qwen))
    bf16.get("text_config", bf16)["mamba_ssm_dtype"] = "bfloat16"
    assert text.get("mamba_ssm_dtype", "float32") == "float32"
    return {"qwen3.5-0.8b": qwen, "qwen3.5-0.8b-bf16": bf16, "gemma-3-270m": GEMMA_270M}


class StubModel(nn.Module):
    """A CausalLM that does no work: zeros for hidden states and logits; the plan's state shapes."""

    narrows_outputs = False
    steps_states_in_place = True  # decodes take the in-pool path (the stub steps nothing)
    packable = False
    batch_invariant = False

    def __init__(self, shapes: dict, hidden: int, vocab: int) -> None:
        super().__init__()
        self.shapes, self.hidden, self.vocab = shapes, hidden, vocab
        self.anchor = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))  # the cache dtype: batched decodes

    def state_shapes(self) -> dict:
        return self.shapes

    def forward(self, ids, positions, attn, states=None, outputs=None):
        return torch.zeros(ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.vocab)


def measure(name: str, config: dict, args: argparse.Namespace) -> dict:
    from hybridkv.engine import engine as engine_module
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.request.sampling_params import SamplingParams

    def stub(model: str, **kw: object) -> StubModel:
        plan = holder["plan"]
        shapes = {} if plan.state is None else {
            s.layer: (tuple(s.spec.conv_shape), tuple(s.spec.ssm_shape)) for s in plan.state.slots
        }  # fmt: skip
        return StubModel(shapes, 8, args.vocab)

    holder: dict = {}
    plan_kv_cache = engine_module.plan_kv_cache

    def keep_plan(*a: object, **kw: object):
        holder["plan"] = plan_kv_cache(*a, **kw)
        return holder["plan"]

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(config))
        engine_module.load_model, saved = stub, engine_module.load_model
        engine_module.plan_kv_cache = keep_plan
        try:
            engine = LLMEngine(EngineConfig(
                model=folder, dtype="bfloat16", kv_cache_memory=args.memory, max_model_len=args.prompt + 512,
                max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.prompt), enable_prefix_caching=True,
            ))  # fmt: skip
        finally:
            engine_module.load_model, engine_module.plan_kv_cache = saved, plan_kv_cache
        params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
        for r in range(args.batch):
            engine.add_request([4 + (r * 7 + i) % 500 for i in range(args.prompt)], params)
        while any(not req.output_token_ids for req in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(3):  # warm-up decode steps
            engine.step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        decoding = len(engine.scheduler.requests)
        assert decoding == args.batch, f"{decoding} of {args.batch} requests are decoding: raise --memory"
        engine.kv.check_integrity()
        plan = engine.plan
        per_request = statistics.median(times) / decoding
        return {
            "model": name,
            "groups": len(plan.groups),
            "state_bytes_per_request": 0 if plan.state is None else plan.state.bytes_per_request,
            "state_pages_per_entry": 0 if plan.state is None else plan.state.num_pages,
            "step_ms_median": statistics.median(times) * 1e3,
            "us_per_request_step": per_request * 1e6,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--vocab", type=int, default=512, help="columns of the stub's logits (sampling cost)")
    parser.add_argument("--memory", default="8GiB", help="KV cache memory per model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(name, config, args) for name, config in configs().items()]
    base = next(r for r in rows if r["model"] == "gemma-3-270m")["us_per_request_step"]
    for r in rows:
        r["vs_attention_only"] = r["us_per_request_step"] / base
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"batch {args.batch}, prompt {args.prompt}, {args.steps} decode steps, {args.threads} thread(s), stub model")
    print(
        f"{'model':<20} {'groups':>6} {'state MiB':>9} {'pages':>5} {'step ms':>8} {'us/req-step':>11} {'vs attn':>7}"
    )
    for r in rows:
        mib = r["state_bytes_per_request"] / 2**20
        print(
            f"{r['model']:<20} {r['groups']:>6} {mib:>9.1f} {r['state_pages_per_entry']:>5} "
            f"{r['step_ms_median']:>8.2f} {r['us_per_request_step']:>11.1f} {r['vs_attention_only']:>7.2f}"
        )


if __name__ == "__main__":
    main()
