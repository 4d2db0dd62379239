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
