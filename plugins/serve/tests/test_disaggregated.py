"""Prefill/decode disaggregation: one Engine prefills, another decodes, same tokens."""

import jax
import numpy as np
import pytest
from axplug_serve.disaggregated import DisaggregatedEngine
from axplug_testing import random_params

from axplug.api.config import make_modifier
from axplug.api.layers import CausalLM
from axplug.api.run import Engine, Request, SamplingParams, load_checkpoint

VOCAB, DIM, HEADS = 61, 32, 4


@pytest.fixture(scope="module")
def rope_model():
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=VOCAB, dim=DIM)
    cfg.decoder.transformer.set(num_layers=1)  # RoPE and grouped KV heads: one layer has both
    cfg.decoder.transformer.layer.attention.set(num_heads=HEADS)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=64)
    for spec in ("rope", "gqa:num_kv_heads=2"):
        cfg = make_modifier(spec)(cfg)
    model = cfg.instantiate(parent=None)
    return model, random_params(model, seed=3)


def random_ids(seed: int, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, shape).astype(np.int32)


def alone(engine, prompt, sampling):
    """`prompt` decoded alone by `engine`, an engine of one row (`solo`)."""
    engine.submit(Request(prompt, sampling))
    (completion,) = engine.run()
    return completion.output_ids


def solo(model, params, max_len=16):
    """An engine of one row, reused for each request: its programs are traced once."""
    return Engine(model, params, num_slots=1, max_len=max_len, min_prefill_len=16)


def submit_four(engine, sampling, *, seed) -> dict[str, list[int]]:
    """Submits four 3-token prompts as requests "a" to "d"; returns the prompts by id."""
    prompts = {name: random_ids(seed + i, 3).tolist() for i, name in enumerate("abcd")}
    for name, prompt in prompts.items():
        engine.submit(Request(prompt, sampling, id=name))
    return prompts


def test_a_disaggregated_engine_cancels_and_finishes_like_one_engine(rope_model):
    model, params = rope_model
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    both = DisaggregatedEngine(
        Engine(model, params, num_slots=1, max_len=16),
        Engine(model, params, num_slots=2, max_len=16),
    )
    prompts = submit_four(both, greedy, seed=40)
    assert both.cancel("d") and not both.cancel("nobody")  # still waiting: dropped at once
    done = {c.id: c for c in both.run()}
    both.close()
    assert done["d"].finish_reason == "cancelled" and done["d"].output_ids == []
    one = solo(model, params)
    for name in "abc":
        assert done[name].output_ids == alone(one, prompts[name], greedy), name
    assert both.transfers == 3 and not both.has_work


def test_the_serve_warm_up_runs_on_a_disaggregated_engine(rope_model):
    """`axplug serve`'s warm-up (every prefill width, then a prompt chunked beside a decoding
    row) on a disaggregated engine, threaded as the server's: it ends with nothing left, and
    the engine then decodes as one engine does (test_serve.py serves one without it)."""
    from axplug_serve.startup import warm_up

    model, params = rope_model
    both = DisaggregatedEngine(
        Engine(model, params, num_slots=1, max_len=16, prefill_chunk=4),
        Engine(model, params, num_slots=2, max_len=16),
    )
    warm_up(both, Request, SamplingParams)
    assert not both.has_work and both.transfers > 0
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    prompts = submit_four(both, greedy, seed=80)
    done = {c.id: c for c in both.run()}
    both.close()
    one = solo(model, params)
    for name in "abcd":
        assert done[name].output_ids == alone(one, prompts[name], greedy), name


@pytest.fixture(scope="module")
def llama_run(trained_run):
    """A llama-tiny run, read by the tests below (trained once per session: shared with other
    modules). Loading lays its parameters out over whichever devices a test names."""
    return str(trained_run("llama-tiny", "input.seq_len=64"))


REQUESTS = [
    Request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8, temperature=0.0), id=0),
    Request([7, 8, 9], SamplingParams(max_new_tokens=6, temperature=0.9, seed=3), id=1),
    Request([10, 11, 12, 13, 14, 15, 16], SamplingParams(max_new_tokens=1), id=2),
    Request([3, 3], SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5), id=3),
    Request([5] * 12, SamplingParams(max_new_tokens=5, temperature=0.0), id=4),
    # Penalties: the decode side rebuilds the moved row's token counts.
    Request([2, 2, 9], SamplingParams(max_new_tokens=7, temperature=0.0, presence_penalty=1.0,
                                      frequency_penalty=1.0, repetition_penalty=1.5), id=5),
]  # fmt: skip


def engine(loaded, **kwargs):
    return Engine(loaded.model, loaded.params, max_len=32, mesh=loaded.mesh,
                  axis_rules=loaded.axis_rules, **kwargs)  # fmt: skip


def outputs(e):
    for r in REQUESTS:
        e.submit(r)
    return {c.id: c.output_ids for c in e.run()}


@pytest.fixture(scope="module")
def second_device(llama_run):
    """The run loaded on the second device: the reference's and the one-device split's decode
    side's (one model, so the engines over it share its compiled programs)."""
    return load_checkpoint(llama_run, devices=jax.devices()[1:2])


@pytest.fixture(scope="module")
def unified(second_device):
    """The tokens of REQUESTS from one engine doing both, on one device (the layout of its
    KV cache changes no token: one reference for every case below). That device is the decode
    side's of the one-device split, whose decode programs are then the ones compiled here."""
    return outputs(engine(second_device, num_slots=3))


@pytest.mark.parametrize(
    ("cache", "split"),
    [("contiguous", "one device each"), ("paged", "fsdp=2,model=2 each")],
)
def test_disaggregated_prefill_and_decode_give_the_unified_tokens(
    llama_run, second_device, unified, cache, split
):
    """Prompts prefilled on one device set, rows moved to another and decoded there: the
    tokens of one engine doing both (greedy and sampled), caches on the decode devices."""
    modifiers = ["paged_kv_cache:page_size=4,num_pages=24"] if cache == "paged" else []
    devices = jax.devices()
    if split == "one device each":
        prefill_devices, decode_devices = devices[:1], devices[1:2]
    else:
        modifiers.append("mesh:fsdp=2,model=2")
        prefill_devices, decode_devices = devices[:4], devices[4:]
    pre = load_checkpoint(llama_run, modifiers=modifiers, devices=prefill_devices)
    if split == "one device each":  # the reference's model: its decode programs, compiled
        dec = second_device
    else:
        dec = load_checkpoint(llama_run, modifiers=modifiers, devices=decode_devices)
    disaggregated = DisaggregatedEngine(
        engine(pre, num_slots=2, prefill_chunk=4),
        engine(dec, num_slots=3),
        decode_mesh=dec.mesh,
        threaded=cache == "paged",  # the prefill side in its own thread, or in step()
    )
    assert outputs(disaggregated) == unified
    assert disaggregated.transfers == 5  # every request but the one-token one moved
    key = jax.tree.leaves(disaggregated.decode._cache)[0]
    assert key.sharding.device_set == set(decode_devices)
    if cache == "paged":
        allocator = disaggregated.decode.allocator
        assert allocator.num_free == allocator.num_pages


def test_a_threaded_prefill_side_wakes_when_decode_rows_finish(rope_model):
    # Decode has one slot and four requests wait: the prefill thread sleeps until a decode
    # row finishes. It used to sleep on an untimed wait that nothing notified when rows
    # finished, and the run hung; now it must end, in order, with every request's tokens.
    import threading

    model, params = rope_model
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    both = DisaggregatedEngine(
        Engine(model, params, num_slots=1, max_len=16),
        Engine(model, params, num_slots=1, max_len=16),
        threaded=True,
    )
    prompts = submit_four(both, greedy, seed=60)
    done: dict = {}
    runner = threading.Thread(
        target=lambda: done.update({c.id: c for c in both.run()}), daemon=True
    )
    runner.start()
    runner.join(120)
    hung = runner.is_alive()
    both.close()
    assert not hung, "the disaggregated run did not finish within 120 s"
    one = solo(model, params)
    for name in "abcd":
        assert done[name].output_ids == alone(one, prompts[name], greedy), name
