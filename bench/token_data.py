"""Data throughput: `prepare-data` tokens/s, and the token-file input against the step it feeds.

    python bench/token_data.py [--copies 8] [--workers 1 2] [--steps 20]

Tokenizes `--copies` copies of the bundled corpus (paragraphs as documents) with a byte-level
BPE `tokenizer.json` trained here (vocab 4096, no download), once per `--workers` value, and
prints tokens/s. Then times `TokenFileInput.batch` (packed and not, llama-tiny's batch of 8 x
256) against llama-tiny's compiled train step on the same machine and prints the ratio
step time / batch time (the input must be >= 20x faster than the step consumes it).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time


def train_tokenizer(directory: pathlib.Path, text: str) -> pathlib.Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    from axplug.input import bundled_corpus_path
    from axplug.input.prepare import prepare_data

    text = bundled_corpus_path().read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        tokenizer = train_tokenizer(root, text)
        sources = []
        for i in range(args.copies):
            (root / f"copy{i}.txt").write_text(text, encoding="utf-8")
            sources.append(root / f"copy{i}.txt")
        megabytes = args.copies * len(text.encode()) / 1e6
        data = None
        for workers in args.workers:
            out = root / f"data{workers}"
            start = time.perf_counter()
            meta = prepare_data(sources, tokenizer=tokenizer, output=out, text_unit="paragraph",
                                docs_per_shard=2000, workers=workers)  # fmt: skip
            seconds = time.perf_counter() - start
            print(
                f"prepare-data, {workers} worker(s): {meta['num_tokens']:,} tokens from "
                f"{megabytes:.1f} MB in {seconds:.2f} s = {meta['num_tokens'] / seconds:,.0f} "
                "tokens/s"
            )
            data = out
        batch_times = time_batches(data, args.steps)
        step = step_time(args.steps)
        for packing, seconds in batch_times.items():
            print(
                f"TokenFileInput.batch (8 x 256, packing={packing}): {seconds * 1e3:.3f} ms; "
                f"llama-tiny step {step * 1e3:.1f} ms; step/batch = {step / seconds:.0f}x"
            )


def time_batches(data: pathlib.Path, steps: int) -> dict[bool, float]:
    from axplug.input.token_file import TokenFileInput

    out = {}
    for packing in (False, True):
        cfg = TokenFileInput.default_config().set(
            path=str(data), seq_len=256, batch_size=8, packing=packing
        )
        inp = cfg.instantiate()
        inp.batch(0)  # the first epoch's permutation
        times = []
        for step in range(1, steps + 1):
            start = time.perf_counter()
            inp.batch(step)
            times.append(time.perf_counter() - start)
        out[packing] = statistics.median(times)
    return out


def step_time(steps: int) -> float:
    """Median seconds of llama-tiny's compiled train step (the trainer's own), one device."""
    import jax

    from axplug.presets import preset_config

    cfg = preset_config(
        "llama-tiny",
        overrides=["output_dir='/tmp/axplug-bench-token-data'", "compilation_cache_dir=None",
                   "summary_writers=[]", "mesh.mesh_shape=(1, 1, 1, 1, 1)"],
    )  # fmt: skip
    trainer = cfg.instantiate(devices=jax.devices()[:1])
    state = trainer.init_state()
    batch = trainer.put_batch(trainer.input.batch(0))
    state, metrics = trainer._train_step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = trainer._train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    trainer.checkpointer.close()
    return statistics.median(times)


if __name__ == "__main__":
    main()
