"""Score a prompt/answer jsonl through lm-eval against a running server (`local-completions`, or
`local-chat-completions` through the model's chat template, k-shot as vLLM's PD accuracy test calls it), offline.

The task YAML is written next to copies of the data and of the few-shot pool in a temporary folder, so lm-eval
needs no network; with a tokenizer folder, lm-eval loads it (`tokenizer_backend=huggingface`) from there.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

TASK = "hybridkv_kv_recall"
TASK_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    fewshot: {fewshot}
test_split: test
fewshot_split: fewshot
target_delimiter: ""
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
"""


def write_task(folder: Path, data: Path, fewshot: Path | None = None, max_tokens: int = 8) -> Path:
    """The task in `folder`: `data` as its test split; `fewshot` (default: kv_recall's seeded pool of
    `SHOT_KEYS` items, which a model folder ships as fewshot.jsonl) as the split shots are drawn from."""
    from hybridkv.tasks import kv_recall

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(data, folder / "data.jsonl")
    if fewshot is None:
        kv_recall.write_jsonl(folder / "fewshot.jsonl", kv_recall.fewshot_pool())
    else:
        shutil.copy(fewshot, folder / "fewshot.jsonl")
    yaml = TASK_YAML.format(
        task=TASK, data=folder / "data.jsonl", fewshot=folder / "fewshot.jsonl", max_tokens=max_tokens
    )
    (folder / f"{TASK}.yaml").write_text(yaml)
    return folder


CHOICE_TASK = "hybridkv_kv_recall_choice"
CHOICE_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
target_delimiter: ""
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def choice_items(items: list[dict], num_choices: int = 4, seed: int = 0) -> list[dict]:
    """kv_recall items as multiple choice: the answer among `num_choices - 1` other items' answers, at a seeded
    place (lm-eval then asks the server for each choice's loglikelihood: echo with logprobs)."""
    rng = random.Random(seed)
    answers = sorted({it["answer"] for it in items})
    out = []
    for it in items:
        others = rng.sample([a for a in answers if a != it["answer"]], num_choices - 1)
        label = rng.randrange(num_choices)
        out.append(
            {"prompt": it["prompt"], "choices": others[:label] + [it["answer"]] + others[label:], "label": label}
        )
    return out


def lm_eval_choice_accuracy(
    base_url: str, model_name: str, data: Path, tokenizer: Path, num_concurrent: int = 4
) -> tuple[float, list[list[float]]]:
    """lm-eval's `local-completions` loglikelihood path on a multiple-choice jsonl (`choice_items`): accuracy,
    and per item the loglikelihood of each choice. lm-eval sends token ids with echo, logprobs 1 and max_tokens
    1, and sums the continuation's token logprobs: what vLLM's prompt logprobs answer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        shutil.copy(data, folder / "data.jsonl")
        (folder / f"{CHOICE_TASK}.yaml").write_text(CHOICE_YAML.format(task=CHOICE_TASK, data=folder / "data.jsonl"))
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(
                f"model={model_name},base_url={base_url}/v1/completions,num_concurrent={num_concurrent},"
                f"tokenized_requests=True,tokenizer_backend=huggingface,tokenizer={tokenizer}"
            ),
            tasks=[CHOICE_TASK],
            task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            log_samples=True,
        )
    samples = sorted(results["samples"][CHOICE_TASK], key=lambda x: x["doc_id"])
    loglikelihoods = [[float(r[0]) for r in sample["filtered_resps"]] for sample in samples]
    return results["results"][CHOICE_TASK]["acc,none"], loglikelihoods


def check_served_model(base_url: str, model_name: str) -> None:
    """Fail with a clear ValueError unless the server at `base_url` answers /v1/models and serves `model_name`
    (lm-eval itself would retry for minutes and end in a transport traceback)."""
    import httpx

    try:
        reply = httpx.get(f"{base_url}/v1/models", timeout=10)
        reply.raise_for_status()
        served = [m["id"] for m in reply.json()["data"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cannot list the models of {base_url} (GET /v1/models: {e}); is the server up?") from e
    if model_name not in served:
        raise ValueError(f"{base_url} serves {', '.join(served)}, not {model_name!r}: pass --served-model-name")


def lm_eval_server_accuracy(
    base_url: str,
    model_name: str,
    data: Path,
    limit: int | None = None,
    num_concurrent: int = 8,
    chat: bool = False,
    num_fewshot: int = 0,
    tokenizer: Path | None = None,
    fewshot: Path | None = None,
) -> float:
    """Exact-match accuracy of the server at `base_url` (e.g. http://127.0.0.1:8000) on `data`. `chat` sends
    each prompt to /v1/chat/completions, after `num_fewshot` shots from `fewshot` as user/assistant turns
    (lm-eval's `fewshot_as_multiturn`); `tokenizer`: a local tokenizer folder for lm-eval (else none)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        include = write_task(Path(tmp), data, fewshot)
        route = "chat/completions" if chat else "completions"
        backend = f"tokenizer_backend=huggingface,tokenizer={tokenizer}" if tokenizer else "tokenizer_backend=None"
        results = lm_eval.simple_evaluate(
            model="local-chat-completions" if chat else "local-completions",
            model_args=(
                f"model={model_name},base_url={base_url}/v1/{route},num_concurrent={num_concurrent},"
                f"tokenized_requests=False,{backend}"
            ),
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(include), include_defaults=False),  # ours only: no scan
            limit=limit,
            num_fewshot=num_fewshot,
            apply_chat_template=chat,
        )
    return results["results"][TASK]["exact_match,none"]


def chat_prompts(folder: Path, items: list[dict], num_fewshot: int, pool: Path | None) -> list[list[int]]:
    """Each item's token ids as the model's chat template renders it after `num_fewshot` shots, drawn from `pool`
    (default: kv_recall's seeded pool) by a generator seeded with the item's index: the same shots on every run.
    The template spells its special tokens, so none are added (as `apply_chat_template(tokenize=True)`)."""
    from hybridkv.engine.tokenizer import Tokenizer
    from hybridkv.serve.chat import render_chat
    from hybridkv.tasks import kv_recall

    shots = kv_recall.read_jsonl(pool) if pool else kv_recall.fewshot_pool()
    if num_fewshot > len(shots):
        raise ValueError(f"--num-fewshot {num_fewshot} but the pool ({pool or 'seeded'}) holds {len(shots)} shots")
    tokenizer = Tokenizer(folder)
    return [
        tokenizer.encode(
            render_chat(str(folder), kv_recall.fewshot_messages(it, random.Random(i).sample(shots, num_fewshot))),
            add_special_tokens=False,
        )
        for i, it in enumerate(items)
    ]
