"""The user-facing surface: `from hybridkv import LLM, SamplingParams`, text prompts, stop strings, seeds, the
`generate` CLI, and bad input."""

from __future__ import annotations

import json
import subprocess

import pytest

from hybridkv import LLM, SamplingParams


@pytest.fixture(scope="module")
def folder(tiny_gemma4):
    return tiny_gemma4


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)


def test_text_and_token_prompts_agree(llm):
    ids = llm.engine.tokenize("hello world")
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    by_text, by_ids = llm.generate(["hello world", ids], greedy)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.prompt == "hello world" and by_text.prompt_token_ids == ids
    assert by_text.outputs[0].text == llm.engine.tokenizer.decode(by_text.outputs[0].token_ids)
    assert by_text.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm):
    def run(seed):
        p = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=seed, ignore_eos=True)
        return llm.generate("the quick", p)[0].outputs[0].token_ids

    assert run(1) == run(1)
    assert len({tuple(run(s)) for s in range(4)}) > 1


def test_stop_string_ends_and_trims_the_text(llm):
    free = llm.generate("the lazy", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = free.text[3:6]
    assert stop
    out = llm.generate("the lazy", SamplingParams(max_tokens=20, temperature=0, stop=[stop], ignore_eos=True))
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop and stop not in o.text
    assert free.text.startswith(o.text)


def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="max_model_len is 256"):
        llm.generate([list(range(4, 300))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert len(llm.generate("hello", SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids) <= 3
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_unknown_model_folder_and_options_are_clear_errors(tmp_path, folder):
    with pytest.raises(ValueError, match=r"no config\.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        LLM(str(folder), kv_layout="diagonal")
    with pytest.raises(ValueError, match="enable_cross_layers_blocks must be true or false"):
        LLM(str(folder), kv_connector_extra_config={"enable_cross_layers_blocks": "maybe"})


def test_generate_cli_streams_text(folder):
    r = subprocess.run(
        [
            "hybridkv",
            "generate",
            "--model",
            str(folder),
            "--prompt",
            "hello world",
            "--max-tokens",
            "6",
            "--threads",
            "1",
            "--kv-cache-memory",
            "16MiB",
            "--max-model-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "tokens in" in r.stderr
    bad = subprocess.run(
        ["hybridkv", "generate", "--model", str(folder), "--prompt", "x", "--kv-layout", "zig"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "kv_layout must be one of" in bad.stderr


def test_eval_scores_exact_matches(folder, llm, tmp_path):
    prompts = ["hello world", "the quick brown", "lazy dog"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, stop=["\n"]))
    right = [{"prompt": p, "answer": o.outputs[0].text} for p, o in zip(prompts, outs)]
    wrong = [{"prompt": p, "answer": o.outputs[0].text + "x"} for p, o in zip(prompts, outs)]
    for items, expect in ((right, "accuracy 1.0000 (3/3)"), (wrong + right[:1], "accuracy 0.2500 (1/4)")):
        data = tmp_path / "set.jsonl"
        data.write_text("".join(json.dumps(it) + "\n" for it in items))
        r = subprocess.run(
            ["hybridkv", "eval", "--model", str(folder), "--data", str(data), "--threads", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert expect in r.stdout


def test_logprobs_are_the_models_log_softmax(llm, folder):
    """Greedy tokens with logprobs=3: each token's logprob is the log-softmax of transformers' logits at that step,
    it tops the alternatives, and the alternatives come most likely first."""
    transformers = pytest.importorskip("transformers")
    import torch

    ids = llm.engine.tokenize("the quick brown")
    out = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))[0].outputs[0]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
    expected = torch.log_softmax(logits, -1)
    for step, e in enumerate(out.logprobs):
        assert e.logprob == pytest.approx(expected[step, e.token_id].item(), abs=1e-4)
        assert len(e.top) == 3 and e.top[0] == (e.token_id, e.logprob)
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
    assert llm.generate([ids], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_bad_ids_and_params_fail_cleanly_and_leave_no_request_behind(llm):
    for bad in ([[2, 99999]], [[2, -1]], ["fine", [2, 99999]]):
        with pytest.raises(ValueError, match="token ids must be integers"):
            llm.generate(bad, SamplingParams(max_tokens=2))
        assert not llm.engine.has_unfinished()  # "fine" was added, then aborted with the batch
    for kw in ({"logprobs": True}, {"top_k": 1.5}, {"seed": 2**70}, {"seed": 1.5}):
        with pytest.raises(ValueError, match=r"logprobs|top_k|seed"):
            SamplingParams(**kw)
    assert SamplingParams(stop=None).stop == ()
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


def test_max_model_len_beyond_the_model_is_refused(folder):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        LLM(str(folder), dtype="float32", kv_cache_memory="16MiB", max_model_len=4096)


def test_min_tokens_also_defers_stop_strings(llm):
    free = llm.generate("the lazy", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    stop = free.text[1:3]
    early = llm.generate("the lazy", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))
    late = llm.generate(
        "the lazy", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop], min_tokens=6)
    )
    assert len(early[0].outputs[0].token_ids) < 6 <= len(late[0].outputs[0].token_ids)


def test_generate_without_a_prompt_runs_a_model_folders_heldout_demo():
    """The embedded GDN hybrid answers its first held-out question, as the default model does."""
    from hybridkv.engine.config import DEFAULT_MODEL_DIR

    gdn = DEFAULT_MODEL_DIR.parent / "gdn-model"
    r = subprocess.run(
        ["hybridkv", "generate", "--model", str(gdn), "--threads", "1", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert ": correct]" in r.stdout, r.stdout
