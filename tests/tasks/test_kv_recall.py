import random
import re

from hybridkv.tasks import kv_recall


def test_items_are_seeded(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    kv_recall.write_jsonl(a, 20, seed=7)
    kv_recall.write_jsonl(b, 20, seed=7)
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
