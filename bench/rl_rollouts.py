"""RL rollouts against the serving engine: decode tokens/s of the `rollouts` input (the
trainer's Engine on the training arrays) and of a serving `Engine` built beside it, on the
same model, prompts and sampling; and what handing the parameters to the rollouts costs.

    python bench/rl_rollouts.py                      # llama-tiny, 8 prompts x 8 completions
    python bench/rl_rollouts.py --max-new-tokens 64 --rounds 7

Both sides decode `--prompts x --group` completions of `--max-new-tokens` tokens (no stop
token, so every completion is full length), `--rounds` interleaved rounds after one warm-up
each; printed as tokens/s medians with min-max spreads and the ratio rollouts / serving. The
rollouts side also scores rewards and builds the batch rows, which the serving side does not.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import jax
    from axplug_rl.rollouts import RolloutInput
    from axplug_testing import tiny_trainer_config

    from axplug.api.data import Policy
    from axplug.api.run import Engine, Request, SamplingParams

    work = pathlib.Path(tempfile.mkdtemp())
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"Q{i}: tell me about the number {i}."}) + "\n"
            for i in range(args.prompts)
        )  # fmt: skip
    )
    batch = args.prompts * args.group
    seq_len = 64 + args.max_new_tokens
    cfg = tiny_trainer_config(work / "run", preset=args.preset, modifiers=["grpo"])
    cfg.input = RolloutInput.default_config().set(
        prompts=str(prompts), tokenizer="bytes", template="plain", batch_size=batch,
        group_size=args.group, seq_len=seq_len, max_new_tokens=args.max_new_tokens,
        rewards=["regex:pattern='[0-9]'"],
    )  # fmt: skip
    trainer = cfg.instantiate()
    state = trainer.init_state()
    rollouts = trainer.input
    policy = Policy(trainer.model, state["params"], trainer.mesh, trainer.mesh_builder.axis_rules)

    started = time.perf_counter()
    for _ in range(1000):
        rollouts.before_batch(0, policy)
    handoff_us = (time.perf_counter() - started) / 1000 * 1e6
    rollouts.batch(0)  # builds the Engine, compiles its steps
    same = rollouts._engine.params is state["params"]

    serving = Engine(trainer.model, state["params"], num_slots=batch, max_len=seq_len + 1,
                     max_logprobs=0, mesh=trainer.mesh,
                     axis_rules=trainer.mesh_builder.axis_rules)  # fmt: skip
    ids = [rollouts.prompts.ids[i % args.prompts] for i in range(batch)]

    def serve() -> float:
        start = time.perf_counter()
        for i, prompt in enumerate(ids):
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, seed=i, logprobs=0)
            serving.submit(Request(prompt, sampling, id=i))
        tokens = sum(len(c.output_ids) for c in serving.run())
        return tokens / (time.perf_counter() - start)

    def rollout(step: int) -> float:
        rollouts._held = None
        rollouts.batch(step)
        return rollouts.metrics(step)["rollout/tokens_per_s"]

    serve()  # warm-up: compiles
    rollout(1000)
    sides: dict[str, list[float]] = {"rollouts": [], "serving": []}
    for r in range(args.rounds):
        sides["rollouts"].append(rollout(r + 1))
        sides["serving"].append(serve())
    jax.effects_barrier()
    print(f"{args.preset}: {args.prompts} prompts x {args.group} completions x "
          f"{args.max_new_tokens} new tokens, {args.rounds} rounds")  # fmt: skip
    for name, values in sides.items():
        print(f"  {name:9s} {statistics.median(values):9.0f} tokens/s "
              f"(min {min(values):.0f}, max {max(values):.0f})")  # fmt: skip
    ratio = statistics.median(sides["rollouts"]) / statistics.median(sides["serving"])
    print(f"  parameters to the rollouts' Engine: the training arrays themselves ({same}), "
          f"{handoff_us:.1f} us per step, 0 bytes copied")  # fmt: skip
    print(f"rollouts/serving decode tokens/s: {ratio:.3f}")
    for modifiers in ([], ["compute_dtype"]):
        mean, worst = _parity(args, work, prompts, modifiers)
        dtype = "bfloat16" if modifiers else "float32"
        print(f"  {dtype:8s} |Engine - trainer| log-probability of a sampled token: "
              f"mean {mean:.2e}, max {worst:.2e}")  # fmt: skip


def _parity(args, work, prompts, modifiers) -> tuple[float, float]:
    """The Engine's log-probability of each sampled token against the trainer's forward."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from axplug_rl.rollouts import RolloutInput
    from axplug_testing import tiny_trainer_config

    from axplug.api.data import Policy
    from axplug.api.layers import functional

    cfg = tiny_trainer_config(work / "parity", preset=args.preset, modifiers=["grpo", *modifiers])
    cfg.input = RolloutInput.default_config().set(
        prompts=str(prompts), tokenizer="bytes", template="plain", batch_size=16, group_size=4,
        seq_len=64 + args.max_new_tokens, max_new_tokens=args.max_new_tokens,
        rewards=["regex:pattern='[0-9]'"],
    )  # fmt: skip
    trainer = cfg.instantiate()
    params = trainer.init_state()["params"]
    trainer.input.before_batch(0, Policy(trainer.model, params, trainer.mesh,
                                         trainer.mesh_builder.axis_rules))  # fmt: skip
    batch = trainer.input.batch(0)
    (_, outputs), _ = functional(trainer.model, prng_key=None, state=params, is_training=False,
                                 inputs={k: jnp.asarray(v) for k, v in batch.items()})  # fmt: skip
    logp = np.asarray(jax.nn.log_softmax(outputs["logits"].astype(jnp.float32), axis=-1))
    labels = np.maximum(batch["target_labels"], 0)
    trained = np.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    sampled = (batch["target_labels"] >= 0) & ~np.isnan(batch["behavior_logps"])
    gap = np.abs(batch["behavior_logps"] - trained)[sampled]
    return float(gap.mean()), float(gap.max())


if __name__ == "__main__":
    main()
