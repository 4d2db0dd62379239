"""PD on recurrent-state hybrids (tiny random Qwen3.5 and Nemotron-H): the state travels with the KV, and the
answer through the proxy is the single instance's to the bit (text and every token's logprob), across layouts,
and again when the decoder already holds a prefix of the prompt (it still pulls the state at the prompt's end),
and when the prefill generated more than one token (its state before the last prompt token was kept aside)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hybridkv import LLM, SamplingParams
from tests.pd.pd_util import assert_clean, complete, fronted, server, transfers
from tests.tiny_models import add_tokenizer

PROMPTS = ["the quick brown fox " * n for n in (1, 2, 5, 9, 14)]  # up to ~280 tokens: around the split unit


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def hybrid(request, tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_5":
        from tests.models.tiny_qwen3_5 import build

        build(folder)
    else:
        from tests.models.tiny_nemotron_h import build_nemotron_h

        build_nemotron_h(folder)
    add_tokenizer(folder)
    return str(folder)


def single(model: str, prompts: list[str], **kw) -> list[tuple[str, list[float]]]:
    llm = LLM(model, kv_cache_memory="32MiB", max_model_len=512, **kw)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    return [(o.outputs[0].text, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def through(url: str, prompts: list[str]) -> list[tuple[str, list[float]]]:
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: complete(url, q, logprobs=0), prompts))
    return [(o["choices"][0]["text"], o["choices"][0]["logprobs"]["token_logprobs"]) for o in outs]


@pytest.mark.parametrize("layouts", [("per-layer", "packed"), ("packed", "packed")])
def test_through_the_proxy_equals_one_instance_bit_for_bit(hybrid, layouts):
    p, d, x = fronted(server(hybrid, layouts[0], wait=False), server(hybrid, layouts[1], wait=False))
    try:
        want = single(hybrid, PROMPTS)
        with transfers(d, at_least=len(PROMPTS) - 1) as first:  # every prompt but the 1-token-short one is read
            assert through(x.url, PROMPTS) == want
        assert_clean(p, d)
        # The decoder now holds these prompts' aligned prefixes; it still reads each prompt's tail and the state.
        with transfers(d, at_least=3) as again:
            assert through(x.url, PROMPTS[2:]) == want[2:]
        assert again["bytes"] < first["bytes"]
        # A prefill that decodes on after its first token (not the proxy's max_tokens 1) keeps its state before
        # the last prompt token aside for the decoder (`keep_state`): the decoder still reads and equals one run.
        lease = complete(p.url, PROMPTS[3], max_tokens=5, kv_transfer_params={"do_remote_decode": True})
        assert lease["kv_transfer_params"] is not None
        with transfers(d, reads=1) as moved:
            out = complete(d.url, PROMPTS[3], logprobs=0, kv_transfer_params=lease["kv_transfer_params"])
        assert (out["choices"][0]["text"], out["choices"][0]["logprobs"]["token_logprobs"]) == want[3]
        assert moved["external_hit_tokens"] > 0
        assert_clean(p, d)
    finally:
        for proc in (x, p, d):
            proc.stop()


def test_int8_states_through_the_proxy_equal_one_int8_instance(hybrid):
    """Quantized states (`--mamba-ssm-cache-dtype int8`) travel as their int8 bytes and scales: the same bits."""
    int8 = ("--mamba-ssm-cache-dtype", "int8")
    p, d, x = fronted(server(hybrid, "per-layer", *int8, wait=False), server(hybrid, "packed", *int8, wait=False))
    try:
        want = single(hybrid, PROMPTS[2:], mamba_ssm_cache_dtype="int8")
        with transfers(d, at_least=3):
            assert through(x.url, PROMPTS[2:]) == want
        assert_clean(p, d)
    finally:
        for proc in (x, p, d):
            proc.stop()


def test_lm_eval_through_the_proxy_on_the_embedded_gdn_model_scores_the_single_instance_score(tmp_path):
    """The seed's accuracy check on the recurrent hybrid: lm-eval local-completions through the PD proxy."""
    pytest.importorskip("lm_eval")
    import json

    from hybridkv.evals import lm_eval_server_accuracy
    from hybridkv.tasks.kv_recall import score

    model = Path(__file__).parents[2] / "hybridkv" / "assets" / "gdn-model"
    items = [json.loads(line) for line in (model / "heldout.jsonl").read_text().splitlines()[:24]]
    data = tmp_path / "subset.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    llm = LLM(str(model), kv_cache_memory="32MiB", max_model_len=512)
    outs = llm.generate([it["prompt"] for it in items], SamplingParams(max_tokens=8, temperature=0, stop=["\n"]))
    single = sum(score(o.outputs[0].text, it["answer"]) for o, it in zip(outs, items)) / len(items)
    p, d, x = fronted(server(str(model), "per-layer", wait=False), server(str(model), "packed", wait=False))
    try:
        with transfers(d, at_least=18):
            assert lm_eval_server_accuracy(x.url, model.name, data) == pytest.approx(single)
        assert_clean(p, d)
    finally:
        for proc in (x, p, d):
            proc.stop()
