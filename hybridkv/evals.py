"""Score a prompt/answer jsonl through lm-eval against a running server (`local-completions`, or
`local-chat-completions` through the model's chat template), offline.

The task YAML is written next to a copy of the data in a temporary folder, so lm-eval needs no network.
"""

from __future__ import annotations

import os
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
test_split: test
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


def write_task(folder: Path, data: Path, max_tokens: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(data, folder / "data.jsonl")
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=folder / "data.jsonl", max_tokens=max_tokens))
    return folder


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
) -> float:
    """Exact-match accuracy of the server at `base_url` (e.g. http://127.0.0.1:8000) on `data`; `chat` sends
    each prompt as one user message to /v1/chat/completions."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        include = write_task(Path(tmp), data)
        route = "chat/completions" if chat else "completions"
        results = lm_eval.simple_evaluate(
            model="local-chat-completions" if chat else "local-completions",
            model_args=(
                f"model={model_name},base_url={base_url}/v1/{route},num_concurrent={num_concurrent},"
                "tokenized_requests=False,tokenizer_backend=None"
            ),
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(include)),
            limit=limit,
            apply_chat_template=chat,
        )
    return results["results"][TASK]["exact_match,none"]
