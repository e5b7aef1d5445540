"""Builds a tiny decoder from configs, runs a jitted forward and backward pass, prints the loss."""

import jax
import jax.numpy as jnp

from axplug.api.layers import CausalLM, functional


def tiny_lm_config():
    cfg = CausalLM.default_config()
    cfg.decoder.set(vocab_size=256, dim=64)
    cfg.decoder.transformer.set(num_layers=2)
    cfg.decoder.transformer.layer.attention.set(num_heads=4)
    cfg.decoder.transformer.layer.feed_forward.set(hidden_dim=128)
    return cfg


def main():
    cfg = tiny_lm_config()
    print(cfg.debug_string())
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.PRNGKey(0))
    tokens = jnp.asarray([list(b"hello, axplug! " * 4)], dtype=jnp.int32)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(p):
        (loss, _), _ = functional(
            model,
            prng_key=jax.random.PRNGKey(1),
            state=p,
            inputs=(inputs, labels),
            is_training=True,
        )
        return loss

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    grad_norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    print(f"params: {num_params:,}  loss: {float(loss):.4f}  grad norm: {float(grad_norm):.4f}")


if __name__ == "__main__":
    main()
