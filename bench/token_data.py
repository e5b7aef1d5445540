"""Data throughput: `prepare-data` tokens/s, and the token-file input against the step it feeds.

    python bench/token_data.py [--copies 8] [--workers 1 2] [--steps 20]

Tokenizes `--copies` copies of the bundled corpus (paragraphs as documents) with a byte-level
BPE `tokenizer.json` trained here (vocab 4096, no download), once per `--workers` value, and
prints tokens/s. Then times `TokenFileInput.batch` (packed and not, llama-tiny's batch of 8 x
256) against llama-tiny's compiled train step on the same machine and prints the ratio
step time / batch time (the input must be >= 20x faster than the step consumes it).

`--store` instead trains llama-tiny (`--train-steps` steps, `--rounds` rounds, interleaved) from
the same byte-level data directory on local disk and in an S3 bucket served by moto on
127.0.0.1 (needs axplug-checkpoint-cloud with its test extras), and prints each side's input
wait (the trainer's `data_wait` phase) as a fraction of its step time, with the range over
rounds; the bucket's rows come by range requests, `prefetch` batches ahead.
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
    parser.add_argument("--store", action="store_true", help="local disk vs an S3 bucket")
    parser.add_argument("--train-steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.store:
        store(args.train_steps, args.rounds)
        return

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


def store(steps: int, rounds: int) -> None:
    """llama-tiny trained from local disk and from an S3 bucket: input wait / step time."""
    import os
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "plugins/checkpoint_cloud/tests"))
    from axplug.input import bundled_corpus_path
    from axplug.input.prepare import prepare_data
    from object_stores import create_s3_bucket, moto_server

    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        server = moto_server().start(root)
        try:
            os.environ.update(AWS_ENDPOINT_URL=server.url, AWS_ACCESS_KEY_ID="bench",
                              AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1")  # fmt: skip
            create_s3_bucket(server.url, "bench")
            sides = {"local": str(root / "data"), "s3": "s3://bench/data"}
            for output in sides.values():
                prepare_data([bundled_corpus_path()], tokenizer="bytes", output=output,
                             text_unit="paragraph", docs_per_shard=500, workers=1,
                             staging=root / "staging")  # fmt: skip
            fractions: dict[str, list[float]] = {side: [] for side in sides}
            step_ms: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(rounds):
                for side, path in sides.items():
                    wait, busy = _train_from(path, root / f"run-{side}-{r}", steps)
                    fractions[side].append(wait / busy)
                    step_ms[side].append(1e3 * busy / steps)
            for side in sides:
                f, ms = fractions[side], step_ms[side]
                print(
                    f"{side:>5}: input wait / step time {statistics.median(f):.2%} "
                    f"[{min(f):.2%}-{max(f):.2%}] over {rounds} rounds of {steps} steps "
                    f"(step {statistics.median(ms):.0f} ms [{min(ms):.0f}-{max(ms):.0f}])"
                )
        finally:
            server.stop()


def _train_from(path: str, output: pathlib.Path, steps: int) -> tuple[float, float]:
    """(input wait seconds, step seconds) of a llama-tiny run of `steps` on `path`."""
    from axplug.input.token_file import TokenFileInput
    from axplug.presets import preset_config

    cfg = preset_config(
        "llama-tiny",
        overrides=[f"output_dir={str(output)!r}", "compilation_cache_dir=None",
                   "summary_writers=[]", f"max_steps={steps}", f"checkpoint_every={steps}"],
    )  # fmt: skip
    cfg.input = TokenFileInput.default_config().set(path=path, seq_len=cfg.input.seq_len,
                                                    batch_size=cfg.input.batch_size)  # fmt: skip
    trainer = cfg.instantiate()
    trainer.run()
    seconds = trainer.goodput.seconds
    return seconds["data_wait"], seconds["step"]


if __name__ == "__main__":
    main()
