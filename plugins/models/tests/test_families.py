"""Every family against transformers itself: a tiny random model (1-d weights perturbed),
`import-hf`, last-position logits within 1e-5, 16 greedy tokens equal, `export-hf` reloaded
by AutoModelForCausalLM as the same class with the same logits."""

import pytest

transformers = pytest.importorskip("transformers")

from axplug.testing import check_against_transformers  # noqa: E402

TOL = 1e-5
SHAPES = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def config(name, **updates):
    return getattr(transformers, f"{name}Config")(**{**SHAPES, **updates})


FAMILIES = {
    "llama": lambda: config("Llama"),
    "llama3-tied-head-dim": lambda: config(
        "Llama",
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),  # fmt: skip
    "llama-yarn": lambda: config(
        "Llama",
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: config("Mistral", sliding_window=5),
    "mistral-no-window": lambda: config("Mistral", sliding_window=None),
    "qwen2": lambda: config("Qwen2"),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(family, tmp_path):
    check = check_against_transformers(FAMILIES[family](), tmp_path)
    assert check.logits_error < TOL, check
    assert check.greedy_axplug == check.greedy_transformers, check
    assert check.export_class == check.architecture
    assert check.export_logits_error < TOL, check
