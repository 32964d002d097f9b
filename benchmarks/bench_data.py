"""``prepare`` throughput and memory: the whole pipeline against the tokenizer library alone.

Run: ``hatch run bench:data`` (``--quick``: a small corpus, one repeat). A byte-level BPE
(vocabulary 8192) is trained once on the built-in corpus; the benchmark corpus is JSONL
made of the built-in corpus's paragraphs, numbered so no two records are equal. Side by
side, interleaved, on the same text:

- **library**: ``tokenizers``' own ``Tokenizer.encode_batch`` over every record, in one
  process, texts already in memory (reading JSON and writing nothing: the ceiling);
- **pipeline**: ``prepare_dataset`` with 1, 2 and all workers: read and parse the JSONL,
  tokenize, route every 20th document to validation, write and hash ``.npy`` shards.

The whole benchmark runs with ``TOKENIZERS_PARALLELISM=false``, so the library uses one
core and "per worker" compares like with like (target: pipeline ≥ 0.8× the library per
worker). Wall-clock ratios need idle cores; the CPU-time columns (this process plus its
finished workers) show the pipeline's cost per MB even on a busy machine. Peak RSS is
then measured in a child process preparing a corpus 20× the built-in one with all workers
(``ru_maxrss`` of the main process and of its largest worker), next to a child that only
imports k3_trainer. ``--rss-gb X`` also measures a generated corpus of about X GB
(BENCHMARKS.md records X = 1).
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported anywhere

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from common import print_table, write_json
from k3_trainer import PrepareOptions, prepare_dataset
from k3_trainer.data import builtin_corpus, default_workers
from k3_trainer.data.tokenizer import HFCodec, train_bpe

TARGET = 0.8
# VmHWM, not ru_maxrss, for the main process: Linux carries the pre-exec high-water mark
# of the forked benchmark process into a child's ru_maxrss. A worker's figure counts the
# pages it shares with the main process after fork.
RSS_CHILD = """
import json, resource, sys
from k3_trainer import PrepareOptions, prepare_dataset
if sys.argv[1] != "import-only":
    prepare_dataset([sys.argv[1]], sys.argv[2],
                    PrepareOptions(tokenizer=sys.argv[3], workers=int(sys.argv[4])))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
main = int(status["VmHWM"].split()[0])
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print(json.dumps({"main_kib": main, "largest_worker_kib": children}))
"""


def paragraphs() -> list[str]:
    documents, _ = builtin_corpus()
    return [p for text in documents for p in text.split("\n\n") if p.strip()]


def write_corpus(path: Path, target_bytes: int) -> int:
    """JSONL records of built-in paragraphs until ``target_bytes`` of text; returns the
    text's UTF-8 size."""
    parts, written, index = paragraphs(), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            text = f"[{index}] {parts[index % len(parts)]}"
            f.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
            index += 1
    return written


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (pool workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def peak_rss(corpus: Path | str, out: Path, tokenizer: Path | str,
             workers: int) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", RSS_CHILD, str(corpus), str(out),
                             str(tokenizer), str(workers)], capture_output=True, text=True,
                            check=True)
    shutil.rmtree(out, ignore_errors=True)
    kib = json.loads(result.stdout)
    return {k.replace("_kib", "_mb"): v / 1024 for k, v in kib.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mb", type=float, help="benchmark corpus size in MB of text")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--rss-gb", type=float, help="also measure peak RSS on X GB")
    parser.add_argument("--rss-tokenizer", choices=["bpe", "bytes"], default="bpe",
                        help="tokenizer of the --rss-gb run (bytes: ~10× faster)")
    parser.add_argument("--json")
    args = parser.parse_args()
    mb = args.mb or (2.0 if args.quick else 24.0)
    repeats = args.repeats or (1 if args.quick else 3)
    cores = default_workers()
    worker_counts = sorted({1, 2, cores})
    results: dict[str, object] = {"cores": cores, "mb": mb}

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        codec = train_bpe(iter(paragraphs()), 8192)
        tokenizer = root / "tokenizer.json"
        tokenizer.write_text(codec.json_text)
        corpus = root / "corpus.jsonl"
        text_bytes = write_corpus(corpus, int(mb * 1e6))
        texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
        library = HFCodec(codec.json_text).tokenizer

        def run_library(fast: bool) -> None:
            (library.encode_batch_fast if fast else library.encode_batch)(
                texts, add_special_tokens=False)

        def run_pipeline(workers: int) -> None:
            out = root / f"out{workers}"
            prepare_dataset([corpus], out, PrepareOptions(tokenizer=tokenizer, workers=workers))
            shutil.rmtree(out)

        cases: dict[str, Callable[[], None]] = {
            "library encode_batch": partial(run_library, False),
            "library encode_batch_fast": partial(run_library, True),
            **{f"pipeline, {w} worker{'s' * (w > 1)}": partial(run_pipeline, w)
               for w in worker_counts}}
        seconds: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):
            for name, fn in cases.items():
                start, cpu_start = time.perf_counter(), cpu_seconds()
                fn()
                seconds[name].append(time.perf_counter() - start)
                cpu[name].append(cpu_seconds() - cpu_start)
        mb = text_bytes / 1e6
        rate = {name: mb / statistics.median(s) for name, s in seconds.items()}
        cpu_rate = {name: mb / statistics.median(s) for name, s in cpu.items()}
        base, cpu_base = rate["library encode_batch"], cpu_rate["library encode_batch"]
        rows = []
        for name in cases:
            workers = int(name.split(", ")[1].split()[0]) if name.startswith("pipeline") else 1
            rows.append([name, f"{statistics.median(seconds[name]):.2f}", f"{rate[name]:.2f}",
                         f"{rate[name] / workers / base:.2f}",
                         f"{statistics.median(cpu[name]):.2f}", f"{cpu_rate[name]:.2f}",
                         f"{cpu_rate[name] / cpu_base:.2f}"])
        print_table(f"prepare throughput: {mb:.1f} MB of JSONL text, BPE 8192, {cores} cores, "
                    f"median of {repeats}", ["", "wall s", "MB/s", "per worker × library",
                                             "CPU s", "MB per CPU s", "× library"], rows)
        results["throughput_mb_s"] = rate
        results["mb_per_cpu_s"] = cpu_rate
        results["per_worker_vs_library"] = {
            name: rate[name] / int(name.split(", ")[1].split()[0]) / base
            for name in rate if name.startswith("pipeline")}
        results["cpu_efficiency_vs_library"] = {
            name: cpu_rate[name] / cpu_base for name in rate if name.startswith("pipeline")}

        builtin_mb = sum(len(d.encode()) for d in builtin_corpus()[0]) / 1e6
        big = root / "big.jsonl"
        big_bytes = write_corpus(big, int(20 * builtin_mb * 1e6))
        rss = {"import only": peak_rss("import-only", root / "x", tokenizer, 1),
               f"20× built-in ({big_bytes / 1e6:.1f} MB)": peak_rss(big, root / "rss", tokenizer,
                                                                    cores)}
        big.unlink()
        if args.rss_gb:
            huge = root / "huge.jsonl"
            huge_bytes = write_corpus(huge, int(args.rss_gb * 1e9))
            start = time.perf_counter()
            name = f"{huge_bytes / 1e9:.2f} GB, {args.rss_tokenizer}"
            rss[name] = peak_rss(huge, root / "rss", "bytes" if args.rss_tokenizer == "bytes"
                                 else tokenizer, cores)
            rss[name]["seconds"] = time.perf_counter() - start
            print(f"{name}: {rss[name]['seconds']:.0f} s")
        print_table(f"peak RSS of prepare ({cores} workers), MB", ["corpus", "main process",
                                                                    "largest worker"],
                    [[name, f"{r['main_mb']:.0f}", f"{r['largest_worker_mb']:.0f}"]
                     for name, r in rss.items()])
        results["peak_rss_mb"] = rss
    worst = min(results["per_worker_vs_library"].values())  # type: ignore[attr-defined]
    worst_cpu = min(results["cpu_efficiency_vs_library"].values())  # type: ignore[attr-defined]
    print(f"\nworst pipeline per worker / library: {worst:.2f} wall, {worst_cpu:.2f} per CPU "
          f"second (target ≥ {TARGET}; wall ratios need idle cores)")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
