"""llama.cpp as an engine of `bench_shapes.py`: the same jobs as `shape_worker.py` answers, run by llama.cpp's
own benchmark tools on the checkpoint converted with its own converter (`benchmarks/setup_llama_cpp.sh` builds
them). Its tools draw their own prompt tokens, so a reply has the job's timing but no tokens.

    batched (n prompts)   llama-batched-bench -npp LEN -ntg N -npl n   its total time t (prompts and decode)
    single (1 prompt)     llama-bench -pg LEN,N                        prompt then N tokens, one stream
    stream (1 prompt)     llama-bench -p LEN -n 0 (TTFT), then -p 0 -n N-1 -d LEN (the decode after LEN tokens)

Peak RSS is each tool process's own (`wait4`): llama.cpp maps the GGUF file, so the weight pages it touches count
there as they do for the engines that copy them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_TREE = Path.home() / ".cache/hybridkv/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp"
OUTTYPES = {"bfloat16": "bf16", "float32": "f32"}

# A random checkpoint has no tokenizer: every model class writes a vocabulary 'none' of the config's size, and
# the converters that count tokenizer.json's entries (Gemma's) read a stub of that size in the staging folder.
CONVERT = """
import sys
from pathlib import Path
llama = Path(sys.argv.pop(1))
sys.path[:0] = [str(llama), str(llama / "gguf-py")]
import convert_hf_to_gguf as conv
from conversion.base import TextModel
def set_vocab(self):
    self.gguf_writer.add_tokenizer_model("none")
    self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
find = conv.get_model_class
def patched(*args, **kwargs):  # the model modules load on demand: patch the class the converter picks
    found = find(*args, **kwargs)
    if issubclass(found, TextModel):
        found.set_vocab = set_vocab
    return found
conv.get_model_class = patched
conv.main()
"""


def gguf(tree: Path, folder: Path, dtype: str) -> Path:
    """`folder`'s checkpoint as GGUF in `dtype` (kept beside it for the next run)."""
    out = folder / f"model-{OUTTYPES[dtype]}.gguf"
    if out.exists():
        return out
    stage = folder / "gguf-staging"
    stage.mkdir(exist_ok=True)
    for f in folder.iterdir():
        if f.suffix in (".json", ".safetensors") and not (stage / f.name).exists():
            (stage / f.name).symlink_to(f.resolve())
    vocab = json.loads((folder / "config.json").read_text())
    vocab = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
    stub = {"model": {"vocab": {f"t{i}": i for i in range(vocab)}}, "added_tokens": []}
    (stage / "tokenizer.json").unlink(missing_ok=True)
    (stage / "tokenizer.json").write_text(json.dumps(stub))
    args = [sys.executable, "-c", CONVERT, str(tree), str(stage), "--outtype", OUTTYPES[dtype], "--outfile", str(out)]
    if "qwen3_5" in (folder / "config.json").read_text():
        args.append("--no-mtp")
    run = subprocess.run(args, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {folder}:\n{run.stderr[-2000:]}")
    return out


class LlamaCppWorker:
    """The `Worker` interface of bench_shapes (`run`, `close`, `engine`) over llama.cpp's tools."""

    engine = "llama.cpp"

    def __init__(self, tree: Path, folder: Path, dtype: str, threads: int) -> None:
        self.bin = tree / "build" / "bin"
        if not (self.bin / "llama-batched-bench").exists():
            raise SystemExit(f"no llama.cpp tools in {self.bin}: run benchmarks/setup_llama_cpp.sh first")
        self.model = gguf(tree, folder, dtype)
        self.threads = str(threads)
        self.peak_mib = 0.0

    def _tool(self, name: str, *args: str) -> str:
        cmd = [str(self.bin / name), "-m", str(self.model), "-t", self.threads, *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}")
        self.peak_mib = max(self.peak_mib, usage.ru_maxrss / 1024)  # ru_maxrss: KiB on Linux
        return out

    def _bench(self, *args: str) -> dict:
        return json.loads(self._tool("llama-bench", "-r", "1", "-o", "json", *args))[0]

    def run(self, prompts: list[list[int]], max_tokens: int, stream: bool = False) -> dict:
        n, length = len(prompts), len(prompts[0])
        reply: dict = {"tokens": [[] for _ in prompts]}
        if stream:  # TTFT of `length` tokens, then the decode after them
            first = self._bench("-p", str(length), "-n", "0")["avg_ns"] / 1e9
            decode = self._bench("-p", "0", "-n", str(max_tokens - 1), "-d", str(length))["avg_ns"] / 1e9
            reply |= {"first_token_s": first, "seconds": first + decode}
        elif n == 1:
            reply["seconds"] = self._bench("-p", "0", "-n", "0", "-pg", f"{length},{max_tokens}")["avg_ns"] / 1e9
        else:
            out = self._tool("llama-batched-bench", "-tb", self.threads, "-c", str(n * (length + max_tokens) + 64),
                             "-npp", str(length), "-ntg", str(max_tokens), "-npl", str(n),
                             "--output-format", "jsonl")  # fmt: skip
            reply["seconds"] = [json.loads(x) for x in out.splitlines() if x.startswith("{")][-1]["t"]
        return reply | {"rss_mib": self.peak_mib}

    def close(self) -> None:
        pass
