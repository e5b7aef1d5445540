"""Mixtral against transformers itself: a tiny random model, `import-hf`, logits within 1e-5,
16 greedy tokens equal, `export-hf` reloaded by AutoModelForCausalLM."""

import pytest

transformers = pytest.importorskip("transformers")

from axplug_models.testing import check_against_transformers  # noqa: E402


def test_mixtral_matches_transformers(tmp_path):
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128, sliding_window=None,
    )  # fmt: skip
    check = check_against_transformers(config, tmp_path)
    assert not check.mismatches(1e-5), check
    assert check.architecture == "MixtralForCausalLM"
