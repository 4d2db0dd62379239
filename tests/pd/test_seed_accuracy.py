"""vLLM's PD accuracy test for Gemma 4, as its seed document calls lm-eval: `local-chat-completions` on
`{BASE_URL}/chat/completions`, `tokenizer_backend=huggingface` (the tokenizer loaded from the model name, here the
embedded model's folder, served under that name), `num_fewshot=5`, `apply_chat_template=True`; the only
additions are our task's manager and a limit. One instance, then 1P1D (per-layer prefill, packed decoder) through
our proxy and through vllm-router: every score equals the single-instance score, and the decoder read the KV."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.evals import TASK, write_task
from hybridkv.pd_accuracy.grid import SweepOptions
from hybridkv.pd_accuracy.mesh import InstancePool, child_env, counters, plain_server, router, settle
from hybridkv.pd_accuracy.models import ModelSpec

lm_eval = pytest.importorskip("lm_eval")
try:
    from hybridkv.connectors.pd.transport import _nixl

    _nixl()
except ValueError:
    pytest.skip("NIXL is not installed (pip install nixl-cu12)", allow_module_level=True)

MODEL_NAME = str(DEFAULT_MODEL_DIR)  # served under its folder's path, so lm-eval finds the tokenizer by the name
NUM_CONCURRENT = 8
LIMIT = 32
SPEC = ModelSpec(MODEL_NAME, DEFAULT_MODEL_DIR)
OPTIONS = SweepOptions(models=("embedded",))


def seed_call(base_url: str) -> float:
    """The seed's lm_eval.simple_evaluate call for Gemma 4 (BASE_URL = the server's /v1)."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), SPEC.data, SPEC.fewshot)
        model_args = (
            f"model={MODEL_NAME},"
            f"base_url={base_url}/v1/chat/completions,"
            f"num_concurrent={NUM_CONCURRENT},"
            "tokenizer_backend=huggingface"
        )
        results = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args=model_args,
            tasks=TASK,
            num_fewshot=5,
            apply_chat_template=True,
            task_manager=TaskManager(include_path=tmp, include_defaults=False),
            limit=LIMIT,
        )
    return results["results"][TASK]["exact_match,none"]


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return child_env(secrets.token_hex(16))


@pytest.fixture(scope="module")
def single(env) -> float:
    proc = plain_server(SPEC, OPTIONS, env)
    try:
        return seed_call(proc.url)
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def pd_pair(env):
    pool = InstancePool(SPEC, OPTIONS, env)
    try:
        yield pool.take(("per-layer",), ("packed",))
    finally:
        pool.stop()


@pytest.mark.parametrize("kind", ["proxy", "vllm-router"])
def test_five_shot_chat_through_pd_scores_the_single_instance_score(single, pd_pair, env, kind):
    if kind == "vllm-router" and shutil.which("vllm-router") is None:
        pytest.skip("vllm-router is not installed (it is in the test extra)")
    (prefill,), (decode,) = pd_pair
    before = counters(decode)
    front = router(kind, [prefill], [decode], env)
    try:
        score = seed_call(front.url)
    finally:
        front.stop()
    after = counters(decode)
    assert settle([prefill, decode]) == []
    assert after.reads - before.reads >= LIMIT and after.failures == before.failures  # the KV came over NIXL
    assert single >= 0.95 and score == single, (kind, score, single)
    print(f"{kind}: 5-shot chat {score:.4f}, one instance {single:.4f}")
