"""Every family against transformers itself: a tiny random model (1-d weights perturbed),
`import-hf`, last-position logits within 1e-5, 16 greedy tokens equal, `export-hf` reloaded
by AutoModelForCausalLM as the same class with the same logits."""

import pytest

transformers = pytest.importorskip("transformers")

from axplug_models.testing import check_against_transformers  # noqa: E402

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
    "llama-linear-rope": lambda: config(
        "Llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    ),
    "mistral": lambda: config("Mistral", sliding_window=5),
    "mistral-no-window": lambda: config("Mistral", sliding_window=None),
    "qwen2": lambda: config("Qwen2"),
    "qwen3": lambda: config("Qwen3", head_dim=16),
    "olmo2": lambda: config("Olmo2", pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma": lambda: config("Gemma", head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma-untied-exact-gelu": lambda: config(
        "Gemma", head_dim=8, tie_word_embeddings=False, hidden_act="gelu", pad_token_id=0
    ),
    "gemma2": lambda: config(
        "Gemma2",
        head_dim=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=6,
        num_hidden_layers=3,
        query_pre_attn_scalar=12,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SHAPES, "num_hidden_layers": 3},
        head_dim=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=6,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "phi3": lambda: config("Phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "phi3-partial-rope": lambda: config(
        "Phi3",
        pad_token_id=0,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    ),
}


# Variants of a family already covered (tied heads, other RoPEs, other activations): slow.
VARIANTS = (
    "llama3-tied-head-dim",
    "mistral-no-window",
    "gemma-untied-exact-gelu",
    "phi3-partial-rope",
    "llama-linear-rope",
    "llama-yarn",
)


@pytest.fixture(scope="module")
def llama_check(tmp_path_factory):
    """LLaMA's check, for its family case and the fine-tune from its import."""
    return check_against_transformers(FAMILIES["llama"](), tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.slow) if f in VARIANTS else f for f in FAMILIES],
)
def test_family_matches_transformers(family, tmp_path, request):
    if family == "llama":
        check = request.getfixturevalue("llama_check")
    else:
        check = check_against_transformers(FAMILIES[family](), tmp_path)
    assert not check.mismatches(TOL), check


def test_a_fine_tune_that_changes_the_rope_exports_the_rope_it_trained(tmp_path, llama_check):
    """`train --from` with another theta and Llama 3 scaling, then `export-hf`: transformers
    computes the fine-tuned model's logits (every RoPE form in config.json is the new one)."""
    import json

    import numpy as np
    import torch
    from axplug_models.testing import PROMPT
    from axplug_testing import cli_main as main
    from transformers import AutoModelForCausalLM

    from axplug.api.run import load_checkpoint

    tuned, out = str(tmp_path / "tuned"), str(tmp_path / "out")
    rope = (
        "rope:theta=50000.0,scaling_factor=4.0,low_freq_factor=1.0,high_freq_factor=2.0,"
        "original_max_position=32"
    )
    args = ["train", "--from", llama_check.run_dir, "--output-dir", tuned, "--max-steps", "2",
            "--modifier", rope, "--input", "synthetic:vocab_size=96",
            "--set", "compilation_cache_dir=None", "--set", "input.seq_len=16",
            "--set", "input.batch_size=8", "--mesh-rule", "none", "--modifier", "mesh",
            "-q"]  # fmt: skip
    assert main(args) == 0
    assert main(["export-hf", tuned, "--output", out]) == 0
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["rope_theta"] == raw["rope_parameters"]["rope_theta"] == 50000.0
    assert raw["rope_parameters"]["rope_type"] == raw["rope_scaling"]["rope_type"] == "llama3"
    ids = np.asarray([PROMPT], np.int32)  # no conversion program to compile
    want = load_checkpoint(tuned).logits(ids)[0, -1]
    model = AutoModelForCausalLM.from_pretrained(out).train(False)
    with torch.no_grad():
        got = model(torch.as_tensor(ids)).logits[0, -1].numpy()
    assert np.max(np.abs(got - want)) < TOL


def test_the_kit_perturbs_norms_of_any_rank_so_swapped_per_head_norms_show():
    """Cohere's q/k norms are [heads, head_dim] ones: left at ones, a family that swapped
    them would match transformers exactly."""
    import torch
    from axplug_models.testing import tiny_transformers_model

    cfg = transformers.CohereConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, use_qk_norm=True,
    )  # fmt: skip

    def swap_changes_logits_by(model) -> float:
        attention = model.model.layers[0].self_attn
        q, k = attention.q_norm.weight, attention.k_norm.weight
        assert q.ndim == 2
        ids = torch.arange(8)[None]
        with torch.no_grad():
            logits = model(ids).logits
            q_data = q.detach().clone()
            q.copy_(k)
            k.copy_(q_data)
            return float((model(ids).logits - logits).abs().max())

    assert swap_changes_logits_by(transformers.AutoModelForCausalLM.from_config(cfg)) == 0.0
    assert swap_changes_logits_by(tiny_transformers_model(cfg)) > TOL  # the kit's tolerance
