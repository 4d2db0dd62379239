"""The fast paths against plain torch, through the engine: packed oneDNN linears, the native in-place decode
kernel, and KV-sharing layers run for the output rows alone. Greedy tokens in float32 (batch-invariant mode off:
it replaces the packed and fused paths) must equal the plain-torch engine's (HYBRIDKV_KERNELS=torch, every
consumer row computed), and each fast path must have run."""

import pytest
import torch

from hybridkv.engine.llm import LLM
from hybridkv.models.base import OutputRows
from hybridkv.request.sampling_params import SamplingParams
from tests.tiny_models import build

PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 90)]  # shorter and longer than the window (16)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=["gemma4", "qwen3", "mistral_sliding"])
def checkpoint(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


def engine(folder, monkeypatch, mode):
    monkeypatch.setenv("HYBRIDKV_KERNELS", mode)
    return LLM(str(folder), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64, batch_invariant=False)


def run(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def test_fast_paths_give_the_torch_tokens(checkpoint, monkeypatch):
    plain = engine(checkpoint, monkeypatch, "torch")
    assert plain.engine.runner.decode_kernel is None
    plain.engine.model.narrows_outputs = False  # every row through every layer
    want_tokens, want_logprobs = run(plain)

    fast = engine(checkpoint, monkeypatch, "native")
    runner, model = fast.engine.runner, fast.engine.model
    packed = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    assert packed, "no linear was packed"
    fused = [m for m in model.modules() if getattr(m, "kernel", None) or getattr(m, "act_and_mul", None)]
    assert fused, "the fused norm and activation kernels were not used"
    calls = []
    kernel = runner.decode_kernel
    assert kernel is not None, "the native decode kernel did not build"
    runner.decode_kernel = lambda *a: calls.append(a[0].shape[0]) or kernel(*a)
    tokens, logprobs = run(fast)
    assert calls, "the in-place decode kernel never ran"
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        for g, w in zip(got, want):
            assert g.token_id == w.token_id and abs(g.logprob - w.logprob) < 1e-4


def test_consumers_run_for_output_rows_only(tmp_path, monkeypatch):
    """A 90-token prompt in chunks of 32: the KV-sharing layers see one row for the chunk that samples and none
    for the others; an owner layer sees every token."""
    llm = LLM(
        str(build("gemma4", tmp_path)),
        dtype="float32",
        kv_cache_memory="64MiB",
        max_num_batched_tokens=32,
        batch_invariant=False,
    )
    model = llm.engine.model
    first, owner = model.consumers_from, model.consumers_from - 1
    assert first < len(model.layers) and all(i in model.kv_sharing for i in range(first, len(model.layers)))
    rows = {first: [], owner: []}
    for i in rows:
        layer = model.layers[i]
        forward = layer.forward
        layer.forward = lambda *a, i=i, f=forward: rows[i].append(a[1].shape[0]) or f(*a)
    seen_outputs = []
    model_forward = model.forward

    def spy(ids, positions, attn, states=None, outputs=None):
        seen_outputs.append(outputs)
        return model_forward(ids, positions, attn, states, outputs)

    model.forward = spy
    llm.generate([list(range(5, 95))], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert rows[owner] == [32, 32, 26, 1]  # three prefill chunks, one decode
    assert rows[first] == [1, 1]  # the skipped chunks return before the consumers
    assert all(isinstance(o, OutputRows) for o in seen_outputs)


def test_prefill_instance_runs_no_consumer_beyond_the_first_token(tmp_path, monkeypatch):
    """What a PD prefill instance does (max_tokens 1): one consumer row per prompt, none per other token."""
    llm = LLM(str(build("gemma4", tmp_path)), dtype="float32", kv_cache_memory="64MiB")
    model = llm.engine.model
    seen = []
    layer = model.layers[model.consumers_from]
    forward = layer.forward
    layer.forward = lambda *a: seen.append(a[1].shape[0]) or forward(*a)
    llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    assert sum(seen) == len(PROMPTS)
    assert torch.get_num_threads() >= 1


def test_output_rows_attend_through_their_own_block_tables(tmp_path):
    """A step whose sorted chunks put a prompt's non-sampling chunk before another's sampling one (a 20-token
    padded chunk before a 300-token tiled one): the output-row attention of the consumer layers must use the
    sampling chunk's block tables, so greedy tokens equal those of every row through every layer."""
    prompts = [list(range(5, 305)), list(range(7, 107))]  # 300 tokens (samples in step 1), 100 (20 of them there)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    folder = build("gemma4", tmp_path)

    def tokens(narrow: bool) -> tuple[list[list[int]], list[list]]:
        llm = LLM(
            str(folder), dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=320, batch_invariant=False
        )
        runner = llm.engine.runner
        llm.engine.model.narrows_outputs = narrow
        steps: list[list] = []  # per step: the tables of every chunk, then (if narrowed) the output rows'
        run, metadata = runner.run, runner._metadata
        runner.run = lambda output: steps.append([]) or run(output)
        runner._metadata = lambda step, tables: steps[-1].append(tables) or metadata(step, tables)
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], [s for s in steps if len(s) == 2]

    want, _ = tokens(narrow=False)
    got, pairs = tokens(narrow=True)
    # The step that matters ran: its output rows' tables are not the first chunks' tables.
    assert any(out != every[: len(out)] for every, out in pairs), pairs
    assert got == want
