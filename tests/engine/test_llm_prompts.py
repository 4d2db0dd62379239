"""`LLM.generate` takes vLLM's prompt forms (text, ids, {"prompt"}, {"prompt_token_ids"}, with "cache_salt") and
`use_tqdm` (a progress bar on stderr, on by default as in vLLM)."""

import pytest

from hybridkv import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
TEXT = "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="8MiB", max_model_len=256)


def test_every_prompt_form_runs_the_same_tokens(llm):
    ids = llm.engine.tokenize(TEXT)
    outs = llm.generate([TEXT, ids, {"prompt": TEXT}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [TEXT, None, TEXT, None]
    single = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_a_cache_salt_in_the_prompt_dict_keeps_the_prefix_apart(llm):
    llm.generate(TEXT + "one", GREEDY, use_tqdm=False)
    before = llm.engine.stats().prefix_hit_tokens
    llm.generate({"prompt": TEXT + "two", "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_hit_tokens == before  # salted: no hit on the unsalted prefix
    llm.generate({"prompt": TEXT + "three"}, GREEDY, use_tqdm=False)
    assert llm.engine.stats().prefix_hit_tokens > before  # unsalted: it hits


@pytest.mark.parametrize(
    "bad, says",
    [({"prompt": "a", "prompt_token_ids": [1]}, "one of 'prompt'"), ({"text": "a"}, "keys .'text'. are not supported")],
)
def test_a_bad_prompt_dict_is_a_clear_error_and_leaves_nothing_behind(llm, bad, says):
    with pytest.raises(ValueError, match=says):
        llm.generate([TEXT, bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_use_tqdm_draws_a_progress_bar_on_stderr(llm, capfd):
    llm.generate([TEXT, TEXT + "x"], GREEDY)
    err = capfd.readouterr().err
    assert "Processed prompts" in err and "2/2" in err and "est. speed in " in err
    llm.generate([TEXT], GREEDY, use_tqdm=False)
    assert capfd.readouterr().err == ""
