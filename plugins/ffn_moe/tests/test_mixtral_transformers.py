"""Mixtral against transformers itself: a tiny random model, `import-hf`, logits within 1e-5,
16 greedy tokens equal, `export-hf` reloaded by AutoModelForCausalLM."""

import pytest

transformers = pytest.importorskip("transformers")

from axplug_models.testing import check_against_transformers  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """transformers' tiny models on one torch thread: with torch's default (a thread per
    core) each tiny op waits on the pool, ~50x the CPU of the forward pass itself (and
    workers share the cores). Restored after this module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_mixtral_matches_transformers(tmp_path):
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, sliding_window=None,
    )  # fmt: skip
    check = check_against_transformers(config, tmp_path)
    assert not check.mismatches(1e-5), check
    assert check.architecture == "MixtralForCausalLM"
