"""The server decodes each stream's text incrementally; it must equal decoding the whole output."""

import random
from types import SimpleNamespace

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.kv.model_kv import load_hf_config
from hybridkv.serve.async_engine import AsyncEngine, _Stream


def test_incremental_text_equals_a_full_decode(tiny_gemma4):
    for folder in (DEFAULT_MODEL_DIR, tiny_gemma4):
        tokenizer = Tokenizer(str(folder))
        host = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer))
        vocab = load_hf_config(folder)["vocab_size"]
        rng = random.Random(0)
        for _ in range(20):
            req = SimpleNamespace(output_token_ids=[])
            stream = _Stream(loop=None, queue=None)
            seen = ""
            for _ in range(rng.randint(1, 60)):
                req.output_token_ids += [rng.randrange(0, vocab) for _ in range(rng.choice([1, 1, 2, 5]))]
                text = AsyncEngine._decoded(host, stream, req)
                assert text.startswith(seen)  # text once produced never changes
                seen = text
            full = tokenizer.decode(req.output_token_ids)
            assert full.startswith(seen)
            if not full.endswith("\ufffd"):
                assert seen == full
