"""DeepSeek-V3's multi-token-prediction weights from a checkpoint (model.layers.{L}.*, L the
layer count): read into the modules with `--modifier mtp`, their logits equal transformers'
`MtpModel` on the same weights; left alone without it."""

import jax
import numpy as np
import pytest

pytest.importorskip("axplug_moe")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from axplug_testing import run_cli  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

from axplug.api.layers import functional  # noqa: E402
from axplug.api.run import load_checkpoint  # noqa: E402

SHAPES = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
    q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=2,
    topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, n_routed_experts=8,
    n_shared_experts=1, max_position_embeddings=128, initializer_range=0.1,
    num_nextn_predict_layers=1,
)  # fmt: skip


def checkpoint_with_mtp(directory):
    """A tiny DeepseekV3ForCausalLM saved with an MTP layer in DeepSeek's layout (its decoder
    layer, enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head);
    the transformers `MtpModel` holding the same weights."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    layers = SHAPES["num_hidden_layers"]
    # One layer more, saved: its last layer is the MTP block in the checkpoint's layout.
    bigger = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**SHAPES, "num_hidden_layers": layers + 1})
    ).train(False)
    main = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**SHAPES)).train(False)
    main.load_state_dict(bigger.state_dict(), strict=False)
    mtp = MtpModel(main, 1).train(False)
    mtp.layers[0].mtp_block.load_state_dict(bigger.model.layers[layers].state_dict())
    with torch.no_grad():  # every norm off 1, so a swapped or missing norm shows
        for name, p in [*main.named_parameters(), *mtp.named_parameters()]:
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    bigger.model.layers[layers].load_state_dict(mtp.layers[0].mtp_block.state_dict())
    main.save_pretrained(directory)
    bigger.save_pretrained(f"{directory}/bigger")
    tensors = load_file(f"{directory}/model.safetensors")
    prefix = f"model.layers.{layers}."
    extra = load_file(f"{directory}/bigger/model.safetensors")
    tensors.update({k: v for k, v in extra.items() if k.startswith(prefix)})
    own = mtp.layers[0]
    for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                         ("post_norm", "shared_head.norm")):  # fmt: skip
        tensors[f"{prefix}{theirs}.weight"] = getattr(own, ours).weight.detach().clone()
    tensors[f"{prefix}embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    tensors[f"{prefix}shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return main, mtp


def test_mtp_weights_import_and_their_logits_equal_transformers(tmp_path):
    main, mtp = checkpoint_with_mtp(tmp_path / "hf")
    # Without the modifier the MTP layer is left alone (it is not an error).
    assert (
        run_cli("import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "plain")).exit_code
        == 0
    )
    result = run_cli("import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run"),
                     "--modifier", "mtp")  # fmt: skip
    assert result.exit_code == 0, result.stderr

    ids = np.random.default_rng(0).integers(0, 96, size=(2, 12)).astype(np.int32)
    with torch.no_grad():
        t_ids = torch.tensor(ids, dtype=torch.long)
        out = main(t_ids, output_hidden_states=True)
        positions = torch.arange(1, 12)[None].expand(2, -1)
        h = mtp.forward_layer(0, out.hidden_states[-1][:, :-1], positions, None,
                              input_ids=t_ids[:, 1:])  # fmt: skip
        want = mtp._project_to_logits(h).numpy()

    loaded = load_checkpoint(str(tmp_path / "run"))
    model = loaded.config.model.instantiate(parent=None)
    predict = jax.jit(
        lambda p, i: functional(
            model, prng_key=None, state=p, inputs=(i,), is_training=False, method="predict_ahead"
        )[0]
    )
    _, (got,) = predict(loaded.params, ids)  # fmt: skip
    np.testing.assert_allclose(np.asarray(got)[:, :-1], want, atol=1e-5, rtol=1e-5)


def test_an_export_writes_the_modules_back_as_they_were_read(tmp_path):
    """import-hf --modifier mtp, then export-hf: the MTP layer's tensors come back equal (the
    embedding's and head's copies are not written: readers take the model's own)."""
    from safetensors.numpy import load_file

    checkpoint_with_mtp(tmp_path / "hf")
    assert run_cli("import-hf", str(tmp_path / "hf"), "--output", str(tmp_path / "run"),
                   "--modifier", "mtp").exit_code == 0  # fmt: skip
    result = run_cli("export-hf", str(tmp_path / "run"), "--output", str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    source = load_file(str(tmp_path / "hf" / "model.safetensors"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    prefix = f"model.layers.{SHAPES['num_hidden_layers']}."
    copies = (f"{prefix}embed_tokens.weight", f"{prefix}shared_head.head.weight")
    want = {k for k in source if k.startswith(prefix) and k not in copies}
    assert want and want == {k for k in written if k.startswith(prefix)}
    for name in want:
        np.testing.assert_array_equal(written[name], source[name], err_msg=name)
