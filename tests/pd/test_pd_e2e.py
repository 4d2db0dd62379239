"""Prefill/decode disaggregation end to end: prefill and decode servers and the proxy as real processes on
loopback, NIXL underneath, on the embedded model and a tiny random Gemma 4 (both with KV-sharing layers)."""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from hybridkv import LLM, SamplingParams
from hybridkv.engine.config import DEFAULT_MODEL_DIR
from tests.pd.attack_util import channel
from tests.pd.pd_util import (
    HELDOUT,
    SHORT,
    assert_clean,
    complete,
    fronted,
    kv_state,
    metrics,
    prefill_only,
    proxy,
    server,
    single_instance,
    transfers,
)
from tests.procs import Process, together


@pytest.fixture(scope="module", autouse=True, params=["mesh secret", "no secret"])
def mesh(request):
    """Every test runs twice: with HYBRIDKV_KV_SECRET set for all instances (authenticated side channel, signed
    params) and without one (loopback only)."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "mesh secret":
            mp.setenv("HYBRIDKV_KV_SECRET", secrets.token_hex(16))
        else:
            mp.delenv("HYBRIDKV_KV_SECRET", raising=False)
        yield request.param


@pytest.fixture(scope="module")
def embedded(mesh):
    p, d, x = fronted(server(str(DEFAULT_MODEL_DIR), wait=False), server(str(DEFAULT_MODEL_DIR), wait=False))
    yield p, d, x
    for proc in (x, p, d):
        proc.stop()


def through_proxy_equals_single_instance(model: str, x: Process, prompts: list[str]) -> None:
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda q: complete(x.url, q), prompts))
    assert [o["choices"][0]["text"] for o in outs] == single_instance(model, prompts)


def test_embedded_model_through_the_proxy_equals_one_instance(embedded):
    p, d, x = embedded
    prompts = [it["prompt"] for it in HELDOUT[:6]] + SHORT
    with transfers(d, at_least=6) as first:  # the long prompts were read, not recomputed
        through_proxy_equals_single_instance(str(DEFAULT_MODEL_DIR), x, prompts)
    assert_clean(p, d)
    # Again. In batch-invariant mode (float32's default) the decoder resumes from its own prefix cache only at a
    # 64-token tile start whose sliding window (16 tokens) it holds; a PD load gave it the window at the prompt's
    # end only, so it pulls each prompt again (with --no-batch-invariant it pulls only the partial last block).
    # The answers stay the single instance's.
    with transfers(d, at_least=3) as again:
        through_proxy_equals_single_instance(str(DEFAULT_MODEL_DIR), x, prompts[:3])
    assert again["bytes"] <= first["bytes"]
    assert_clean(p, d, timeout=2)


def test_mixed_layouts_packed_prefill_to_per_layer_decode(embedded):
    _, d, _ = embedded
    p = server(str(DEFAULT_MODEL_DIR), "packed", wait=False)
    x = proxy(p, d, wait=False)
    together(p, x)
    try:
        with transfers(d, reads=4):
            through_proxy_equals_single_instance(str(DEFAULT_MODEL_DIR), x, [it["prompt"] for it in HELDOUT[6:10]])
        assert_clean(p, d)
    finally:
        x.stop()
        p.stop()


@pytest.mark.parametrize("prefill_layout", ["packed", "per-layer"])
def test_tiny_gemma4_with_kv_sharing_into_a_packed_decoder(tiny_gemma4, prefill_layout):
    folder = str(tiny_gemma4)
    p, d, x = fronted(server(folder, prefill_layout, wait=False), server(folder, "packed", wait=False))
    try:
        prompts = ["the quick brown fox " * n for n in (1, 3, 9, 20)]  # 4 to ~80 tokens: around the window
        with transfers(d, at_least=3):
            through_proxy_equals_single_instance(folder, x, prompts)
        assert_clean(p, d)
    finally:
        for proc in (x, p, d):
            proc.stop()


def test_lm_eval_through_the_proxy_scores_the_single_instance_score(embedded, tmp_path):
    """The seed's accuracy check, ours: lm-eval local-completions through the PD proxy."""
    pytest.importorskip("lm_eval")
    from hybridkv.evals import lm_eval_server_accuracy
    from hybridkv.tasks.kv_recall import score

    items = HELDOUT[:24]
    data = tmp_path / "subset.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in items))
    llm = LLM(kv_cache_memory="32MiB", max_model_len=512)
    outs = llm.generate([it["prompt"] for it in items], SamplingParams(max_tokens=8, temperature=0, stop=["\n"]))
    single = sum(score(o.outputs[0].text, it["answer"]) for o, it in zip(outs, items)) / len(items)
    p, d, x = embedded
    with transfers(d, at_least=18):  # at least the 18 prompts new to this decoder are read
        assert lm_eval_server_accuracy(x.url, DEFAULT_MODEL_DIR.name, data) == pytest.approx(single) and single >= 0.9
    assert_clean(p, d)


def test_lm_eval_loglikelihood_through_the_proxy_equals_one_instance(embedded, tmp_path):
    """lm-eval's loglikelihood path (a multiple-choice task: echo, logprobs 1, max_tokens 1, prompt token ids):
    through the PD proxy every choice's loglikelihood equals one instance's to the bit. Prompt logprobs need every
    prompt token's logits, so the decoder computes the prompt (it reads nothing, and frees the prefill's lease)."""
    pytest.importorskip("lm_eval")
    from hybridkv.evals import choice_items, lm_eval_choice_accuracy

    data = tmp_path / "choices.jsonl"
    data.write_text("".join(json.dumps(it) + "\n" for it in choice_items(HELDOUT[100:112])))
    p, d, x = embedded
    acc_one, one = lm_eval_choice_accuracy(p.url, DEFAULT_MODEL_DIR.name, data, DEFAULT_MODEL_DIR)
    with transfers(d, reads=0):
        acc_pd, pd = lm_eval_choice_accuracy(x.url, DEFAULT_MODEL_DIR.name, data, DEFAULT_MODEL_DIR)
    assert pd == one and acc_pd == acc_one >= 0.9, (acc_one, acc_pd)
    print(f"loglikelihood task, {len(one)} items x 4 choices: accuracy {acc_one:.4f} on one instance, {acc_pd:.4f} "
          f"through the PD proxy; first item {one[0]}")  # fmt: skip
    assert_clean(p, d)


def test_an_expired_lease_frees_prefill_and_the_decoder_recomputes(embedded):
    p, d, _ = embedded
    prompt = HELDOUT[20]["prompt"]
    params = prefill_only(p, prompt)
    assert kv_state(p)["blocks_used"] > 0  # held under the lease
    time.sleep(3.5)
    assert kv_state(p)["blocks_used"] == 0 and kv_state(p)["connector"]["kv_leases_expired_total"] >= 1
    start = time.monotonic()
    # The decoder confirms the lease before reading: it had ended, so no read starts (one would wait for its
    # timeout, as the prefill no longer drives the transfer) and the request recomputes at once.
    with transfers(d, reads=0, failures=1):
        out = complete(d.url, prompt, kv_transfer_params=params)  # the blocks may be reused: never trust them
    assert time.monotonic() - start < 5
    assert out["choices"][0]["text"] == single_instance(str(DEFAULT_MODEL_DIR), [prompt])[0]
    assert_clean(p, d)


def test_prefill_dying_after_prefill_makes_the_decoder_recompute(embedded):
    _, d, _ = embedded
    p = server(str(DEFAULT_MODEL_DIR))
    prompt = HELDOUT[21]["prompt"]
    params = prefill_only(p, prompt)
    p.kill()
    with transfers(d, reads=0, failures=1):
        out = complete(d.url, prompt, kv_transfer_params=params)
    assert out["choices"][0]["text"] == single_instance(str(DEFAULT_MODEL_DIR), [prompt])[0]
    assert_clean(d)
    p.stop()


def test_prefill_frozen_then_killed_mid_transfer_makes_the_decoder_recompute(embedded):
    """The prefill instance stops answering while the decoder transfers (SIGSTOP), then dies: whatever the read
    returned is not trusted (the lease cannot be confirmed), and the decoder recomputes."""
    _, d, _ = embedded
    p = server(str(DEFAULT_MODEL_DIR))
    try:
        warm = HELDOUT[24]["prompt"]  # first request: the handshake is done before the freeze
        with transfers(d, reads=1):
            assert complete(d.url, warm, kv_transfer_params=prefill_only(p, warm))["choices"]
        prompt = HELDOUT[25]["prompt"]
        params = prefill_only(p, prompt)
        p.proc.send_signal(signal.SIGSTOP)
        killer = threading.Timer(1.0, p.kill)
        killer.start()
        with transfers(d, reads=0, failures=1):  # the lease could not be confirmed: nothing was read
            out = complete(d.url, prompt, kv_transfer_params=params)
        killer.join()
        assert out["choices"][0]["text"] == single_instance(str(DEFAULT_MODEL_DIR), [prompt])[0]
        assert_clean(d)
    finally:
        p.stop()


def test_decode_dying_mid_wait_leaves_prefill_to_free_on_lease_expiry(embedded):
    p, _, _ = embedded
    d = server(str(DEFAULT_MODEL_DIR))
    prompt = HELDOUT[22]["prompt"]
    params = prefill_only(p, prompt)
    body = {"prompt": prompt, "max_tokens": 64, "stream": True, "kv_transfer_params": params}
    with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=60):
        d.kill()
    assert_clean(p, timeout=20)  # the lease is 3 s; a loaded machine sweeps it late
    d.stop()


def test_incompatible_peer_is_refused_with_a_clear_error_under_policy_fail(embedded):
    p, _, _ = embedded
    d = server(str(DEFAULT_MODEL_DIR), "per-layer", "--dtype", "bfloat16", kv_load_failure_policy="fail")
    try:
        prompt = HELDOUT[23]["prompt"]
        with transfers(d, reads=0, failures=1):
            r = httpx.post(
                f"{d.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 4, "kv_transfer_params": prefill_only(p, prompt)},
                timeout=60,
            )
        assert r.status_code == 502 and "incompatible KV" in r.json()["error"]["message"]
        assert "refused a handshake" in p.output()
        assert_clean(p, d)
    finally:
        d.stop()


def test_client_aborts_before_and_during_the_transfer_free_both_sides(embedded):
    p, d, x = embedded
    for delay in (0.0, 0.02, 0.1):
        body = {"prompt": HELDOUT[30]["prompt"], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{x.url}/v1/completions", json=body, timeout=60):
            time.sleep(delay)
    assert_clean(p, d)


def test_a_request_the_decoder_refuses_releases_the_prefill_lease(embedded):
    """min_tokens > max_tokens passes the prefill step (the proxy drops min_tokens there) and is refused by the
    decoder: the proxy releases the prefill's blocks at once instead of leaving them leased."""
    p, d, x = embedded
    for stream in (False, True):
        body = {"prompt": HELDOUT[31]["prompt"], "max_tokens": 2, "min_tokens": 5, "stream": stream}
        with transfers(d, reads=0):  # refused before any transfer: nothing read, nothing failed
            r = httpx.post(f"{x.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "min_tokens" in r.text
        assert kv_state(p)["blocks_used"] == 0
    assert_clean(p, d)


def test_a_side_channel_port_in_use_is_a_clear_start_up_error(embedded):
    p, _, _ = embedded
    with pytest.raises(RuntimeError, match="side_channel_port"):
        server(str(DEFAULT_MODEL_DIR), side_channel_port=channel(p))  # the port p bound


def prompt_tokens(p: Process) -> float:
    return metrics(p)["vllm:prompt_tokens_total"]


def test_the_proxy_round_robins_over_prefill_instances(embedded):
    p, d, _ = embedded
    p2 = server(str(DEFAULT_MODEL_DIR), "packed", wait=False)
    x = Process("proxy", "--prefill", p.url, p2.url, "--decode", d.url, wait=False)
    together(p2, x)
    try:
        assert httpx.get(f"{x.url}/health").json()["prefill"] == [p.url, p2.url]
        before = prompt_tokens(p), prompt_tokens(p2)
        with transfers(d, reads=4):
            through_proxy_equals_single_instance(str(DEFAULT_MODEL_DIR), x, [it["prompt"] for it in HELDOUT[40:44]])
        assert prompt_tokens(p) > before[0] and prompt_tokens(p2) > before[1]
        assert_clean(p, p2, d)
    finally:
        x.stop()
        p2.stop()
