"""Each request's text is decoded incrementally; it must equal decoding the whole output."""

import random

from hybridkv.engine.config import DEFAULT_MODEL_DIR
from hybridkv.engine.detokenizer import IncrementalDetokenizer
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.kv.model_kv import load_hf_config
from hybridkv.request.sampling_params import SamplingParams
from hybridkv.request.state import Request


def test_incremental_text_equals_a_full_decode(tiny_gemma4):
    for folder in (DEFAULT_MODEL_DIR, tiny_gemma4):
        tokenizer = Tokenizer(str(folder))
        vocab = load_hf_config(folder)["vocab_size"]
        rng = random.Random(0)
        for _ in range(20):
            req = Request("r", [1], SamplingParams(max_tokens=1000), 16)
            detok = IncrementalDetokenizer(tokenizer, req, 10_000)
            seen = ""
            for _ in range(rng.randint(1, 60)):
                req.output_token_ids += [rng.randrange(0, vocab) for _ in range(rng.choice([1, 1, 2, 5]))]
                text = detok.visible_text()
                assert text.startswith(seen)  # text once produced never changes
                seen = text
            full = tokenizer.decode(req.output_token_ids)
            assert full.startswith(seen)
            if not full.endswith("\ufffd"):
                assert seen == full
