import random
import re

from hybridkv.tasks import kv_recall


def test_items_are_seeded(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    kv_recall.write_jsonl(a, kv_recall.make_items(20, seed=7))
    kv_recall.write_jsonl(b, kv_recall.make_items(20, seed=7))
    assert a.read_text() == b.read_text()
    assert kv_recall.read_jsonl(a) != [kv_recall.make_item(random.Random(8)) for _ in range(20)]


def test_prompt_ends_right_before_the_value_bound_to_its_key():
    rng = random.Random(0)
    for _ in range(200):
        item = kv_recall.make_item(rng)
        key = re.search(r"Q: what is (\w+)\?\nA: (\w+)$", item["prompt"])
        assert key and key[1] == key[2]
        lines = item["prompt"].splitlines()
        bound = [ln for ln in lines if ln.startswith(f"- {key[1]} ") and "note" not in ln]
        assert bound == [f"- {key[1]}{item['answer']}"]
        assert re.fullmatch(r" \d{2,4}", item["answer"])
        values = [ln.split()[2] for ln in lines if re.fullmatch(r"- \w+ \d+", ln)]
        assert len({v[0] for v in values}) == len(values) and values[-1] != item["answer"].strip()


def test_training_spans_cover_each_answer_and_its_newline():
    text, spans = kv_recall.make_training_text(random.Random(1), max_queries=6)
    assert spans and all(re.fullmatch(r" \d{2,4}\n", text[lo:hi]) for lo, hi in spans)
    assert all(text[:lo].rsplit("\n", 1)[-1].startswith("A: ") for lo, _ in spans)


def test_score_is_exact_match_up_to_the_first_newline():
    assert kv_recall.score(" 042\nQ: what is", " 042")
    assert kv_recall.score("042", " 042")
    assert not kv_recall.score(" 0421", " 042")
    assert not kv_recall.score(" 04\n2", " 042")
    assert not kv_recall.score("", " 042")


def test_fewshot_messages_are_lm_evals_multiturn_shape():
    item, shots = kv_recall.make_items(3, seed=5, keys=kv_recall.SHOT_KEYS)[0], kv_recall.make_items(2, seed=6)
    messages = kv_recall.fewshot_messages(item, shots)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in messages[:4:2]] == [s["prompt"] for s in shots]
    assert [m["content"] for m in messages[1:4:2]] == [s["answer"] for s in shots]
    assert messages[-1]["content"] == item["prompt"] and kv_recall.fewshot_messages(item, []) == messages[-1:]


def bound_keys(text: str) -> set[str]:
    return {m[1] for m in re.finditer(r"^- (\w+) \d+$", text, re.M)}


def test_a_training_chat_binds_each_key_once_and_answers_every_question():
    assert not set(kv_recall.KEYS) & set(kv_recall.SHOT_KEYS)
    assert not set().union(*(bound_keys(it["prompt"]) for it in kv_recall.fewshot_pool())) & set(kv_recall.KEYS)
    rng = random.Random(2)
    for shots in range(6):
        chat = kv_recall.make_training_chat(rng, shots)
        users = [m["content"] for m in chat if m["role"] == "user"]
        assert [m["role"] for m in chat] == ["user", "assistant"] * (len(chat) // 2)
        keys = [bound_keys(u) for u in users]
        assert all(not a & b for i, a in enumerate(keys) for b in keys[i + 1 :])  # no key bound twice
        for question, answer in zip(users, (m["content"] for m in chat if m["role"] == "assistant")):
            key = re.search(r"Q: what is (\w+)\?\nA: \1$", question)[1]
            bound = [u for u in users if re.search(rf"^- {key} \d+$", u, re.M)]
            assert len(bound) == 1 and f"- {key}{answer}\n" in bound[0]
