"""Where chat templates come from: chat_template.jinja, tokenizer_config.json (string or named list), or none."""

import json

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.serve.chat import render_chat

MESSAGES = [{"role": "user", "content": "Q: what is mat?"}]


def test_embedded_model_renders_turn_markers_and_the_generation_prompt():
    assert render_chat(str(DEFAULT_MODEL_DIR), MESSAGES) == "<|user|>Q: what is mat?<|model|>"


def test_template_file_config_string_named_list_and_fallback(tmp_path):
    jinja, config, named, plain = (tmp_path / n for n in ("jinja", "config", "named", "plain"))
    for d in (jinja, config, named, plain):
        d.mkdir()
    (jinja / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")
    (config / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<{{ messages[0]['content'] }}>"}))
    templates = [{"name": "tool_use", "template": "no"}, {"name": "default", "template": "{{ bos_token }}hi"}]
    (named / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates, "bos_token": "<s>"}))
    assert render_chat(str(jinja), MESSAGES) == "[Q: what is mat?]"
    assert render_chat(str(config), MESSAGES) == "<Q: what is mat?>"
    assert render_chat(str(named), MESSAGES) == "<s>hi"
    assert render_chat(str(plain), MESSAGES) == "user: Q: what is mat?\nassistant:"


# Templates in the shapes models ship: each spells its own special tokens, two of them a BOS.
TEMPLATES = {
    "embedded": None,
    "llama3": "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{% endif %}",
    "gemma": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
    "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}"
    "<start_of_turn>model\n{% endif %}",
    "chatml": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "qwen": "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}
CHAT = [
    {"role": "user", "content": "Q: what is mat?"},
    {"role": "assistant", "content": "a rug"},
    {"role": "user", "content": "and cat?"},
]
BOS = 2  # the embedded tokenizer's <bos>


def template_folder(tmp_path, name: str):
    """The embedded model's tokenizer files with one of TEMPLATES as its chat template."""
    import shutil

    if TEMPLATES[name] is None:
        return DEFAULT_MODEL_DIR
    folder = tmp_path / name
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, folder / f)
    (folder / "chat_template.jinja").write_text(TEMPLATES[name])
    return folder


def hf_chat_ids(folder) -> list[int]:
    transformers = __import__("pytest").importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_chat_token_ids_equal_transformers_for_five_templates(tmp_path):
    from hybridkv.engine.tokenizer import Tokenizer

    for name in TEMPLATES:
        folder = template_folder(tmp_path, name)
        ours = Tokenizer(folder).encode(render_chat(str(folder), CHAT), add_special_tokens=False)
        expected = hf_chat_ids(folder)
        assert ours == expected, name
        assert ours.count(BOS) == (1 if "bos_token" in (TEMPLATES[name] or "") else 0), name


def test_a_served_chat_holds_the_bos_exactly_once(tmp_path):
    """Through a real server: /tokenize of messages and a chat's prompt_tokens equal transformers' ids, for a
    template that writes `{{ bos_token }}` itself (the tokenizer would add a second one)."""
    import httpx

    from tests.serve.conftest import start_server

    folder = template_folder(tmp_path, "llama3")
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / f).symlink_to(DEFAULT_MODEL_DIR / f)
    expected = hf_chat_ids(folder)
    assert expected[0] == BOS and expected.count(BOS) == 1
    server = start_server(folder)
    url = next(server)
    try:
        tokens = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["tokens"]
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 1, "temperature": 0}
        usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        prompt_tokens = httpx.post(f"{url}/tokenize", json={"prompt": "and cat?"}).json()["tokens"]
    finally:
        server.close()
    assert tokens == expected
    assert usage["prompt_tokens"] == len(expected)
    assert prompt_tokens[0] == BOS  # a plain prompt still gets the tokenizer's own BOS, as in vLLM


def test_chat_template_flag_takes_a_file_or_inline_text_and_refuses_anything_else(tmp_path):
    import pytest

    from hybridkv.serve.chat import ChatRenderer

    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATES["chatml"])
    for value in (str(file), TEMPLATES["chatml"]):
        assert ChatRenderer.load(str(DEFAULT_MODEL_DIR), value).render(MESSAGES) == (
            "<|im_start|>user\nQ: what is mat?<|im_end|>\n<|im_start|>assistant\n"
        )
    with pytest.raises(ValueError, match="neither a file nor an inline Jinja template"):
        ChatRenderer.load(str(DEFAULT_MODEL_DIR), str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        ChatRenderer.load(str(DEFAULT_MODEL_DIR), "{% for m in messages %}")


def test_a_served_chat_template_flag_replaces_the_models(tmp_path):
    """`hybridkv serve --chat-template FILE`: chats are the token ids transformers gives a folder holding that
    template; a template that does not parse stops the server at start with exit 2."""
    import subprocess

    import httpx

    from tests.serve.conftest import ENGINE_ARGS, start_server

    expected = hf_chat_ids(template_folder(tmp_path, "gemma"))
    file = tmp_path / "gemma.jinja"
    file.write_text(TEMPLATES["gemma"])
    server = start_server(DEFAULT_MODEL_DIR, "--chat-template", str(file))
    url = next(server)
    try:
        tokens = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    finally:
        server.close()
    assert tokens == expected
    bad = subprocess.run(
        ["hybridkv", "serve", "--port", "0", *ENGINE_ARGS, "--chat-template", "{% if %}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "chat template does not parse" in bad.stderr
