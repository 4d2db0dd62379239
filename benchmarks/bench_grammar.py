"""Grammar libraries on the sampler's hot path: llguidance vs xgrammar, on the embedded model's tokenizer (vocab 428)
and on a real-size byte-level BPE (32000 tokens, trained here on the Python standard library's sources: no
download). Per library and tokenizer: import time, tokenizer setup, schema compile (cold: a fresh compiler, no
cache), per-request matcher creation from the compiled grammar, and per generated token the mask fill (the bitmask
the sampler applies) and the advance (accepting the sampled token), over the tokens of a valid JSON instance.

    python benchmarks/bench_grammar.py [--repeats 5]

Each library runs in its own subprocess, so import times are cold and one library's threads never share a process
with the other's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

EMBEDDED = Path(__file__).resolve().parents[1] / "hybridkv" / "assets" / "default-model"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
INSTANCE = {
    "name": "Ada Lovelace, the first programmer",
    "age": 36,
    "email": "ada@analytical.org",
    "tags": ["red", "blue", "green"],
    "address": {"street": "12 St James's Square", "zip": "01234"},
    "active": True,
}


def train_tokenizer(folder: Path, vocab_size: int = 32000) -> Path:
    """A byte-level BPE of real size, trained on the standard library's sources (a few seconds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    tok.train_from_iterator((f.read_text(errors="replace") for f in files), trainer)
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def measure(lib: str, tokenizer_json: str, vocab_size: int, eos: list[int], repeats: int) -> dict:
    """Runs in a subprocess: one library, one tokenizer. Times in milliseconds (microseconds per token)."""
    t0 = time.perf_counter()
    if lib == "llguidance":
        import llguidance
        import llguidance.numpy as lnp
    else:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    out: dict = {"import_ms": (time.perf_counter() - t0) * 1e3}
    from tokenizers import Tokenizer

    text = json.dumps(INSTANCE, separators=(",", ":"))
    tokens = Tokenizer.from_file(tokenizer_json).encode(text, add_special_tokens=False).ids
    out["tokens"] = len(tokens)
    t0 = time.perf_counter()
    if lib == "llguidance":
        tok = llguidance.LLTokenizer(Path(tokenizer_json).read_text(), n_vocab=vocab_size, eos_token=eos)
    else:
        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
    out["tokenizer_ms"] = (time.perf_counter() - t0) * 1e3
    compiles, creates, masks, advances = [], [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if lib == "llguidance":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
            template = llguidance.LLMatcher(tok, grammar, log_level=0)
            assert not template.is_error(), template.get_error()
        else:
            compiled = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
                SCHEMA, any_whitespace=False, separators=(",", ":")
            )
        compiles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if lib == "llguidance":
            matcher = template.deep_copy()
            bitmask = lnp.allocate_token_bitmask(1, vocab_size)
        else:
            matcher = xgrammar.GrammarMatcher(compiled)
            bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        creates.append(time.perf_counter() - t0)
        for t in tokens:
            t0 = time.perf_counter()
            if lib == "llguidance":
                lnp.fill_next_token_bitmask(matcher, bitmask, 0)
            else:
                matcher.fill_next_token_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            ok = matcher.consume_token(t) if lib == "llguidance" else matcher.accept_token(t)
            t2 = time.perf_counter()
            assert ok, f"{lib} refused token {t} of a valid instance"
            masks.append(t1 - t0)
            advances.append(t2 - t1)
        done = matcher.is_accepting() if lib == "llguidance" else matcher.accept_token(eos[0])
        assert done, f"{lib}: the whole instance did not complete the schema"
    out["compile_ms"] = statistics.median(compiles) * 1e3
    out["matcher_ms"] = statistics.median(creates) * 1e3
    out["mask_us"] = statistics.median(masks) * 1e6
    out["mask_p99_us"] = sorted(masks)[int(len(masks) * 0.99)] * 1e6
    out["advance_us"] = statistics.median(advances) * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", nargs=4, metavar=("LIB", "TOKENIZER", "VOCAB", "EOS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        lib, path, vocab, eos = args.child
        print(json.dumps(measure(lib, path, int(vocab), json.loads(eos), args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        big = train_tokenizer(Path(tmp))
        print(f"trained the 32000-token BPE in {time.perf_counter() - t0:.1f} s")
        cases = [("embedded (428)", str(EMBEDDED / "tokenizer.json"), 428, [1, 202, 427]),
                 ("BPE 32000", str(big), 32000, [1])]  # fmt: skip
        head = ["tokenizer", "library", "import ms", "tok setup ms", "compile ms", "matcher ms", "mask us/tok",
                "mask p99 us", "advance us/tok"]  # fmt: skip
        print("".join(f"{h:>15}" if i > 1 else f"{h:<16}" for i, h in enumerate(head)))
        for name, path, vocab, eos in cases:
            for lib in ("llguidance", "xgrammar"):
                cmd = [sys.executable, __file__, "--repeats", str(args.repeats), "--child", lib, path, str(vocab)]
                proc = subprocess.run([*cmd, json.dumps(eos)], capture_output=True, text=True, check=True)
                r = json.loads(proc.stdout)
                cells = [r[k] for k in ("import_ms", "tokenizer_ms", "compile_ms", "matcher_ms", "mask_us",
                                         "mask_p99_us", "advance_us")]  # fmt: skip
                print(f"{name:<16}{lib:<16}" + "".join(f"{c:>15.1f}" for c in cells))
    print(f"\n(the instance is {len(json.dumps(INSTANCE, separators=(',', ':')))} characters of compact JSON; "
          f"medians over {args.repeats} repetitions)")  # fmt: skip


if __name__ == "__main__":
    main()
