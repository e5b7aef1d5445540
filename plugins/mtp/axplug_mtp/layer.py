"""Multi-token prediction (DeepSeek-V3): D sequential modules, each predicting one token
further ahead from the previous depth's hidden states and the next token's embedding.

Module k (1..D) at position i: h_k = post_norm(block(eh_proj([enorm(E(t_{i+k}));
hnorm(h_{k-1})]))), with h_0 the main model's output after its final norm (what transformers'
`MtpModel` and vLLM feed DeepSeek-V3's trained modules); its logits are the main model's head
(shared, without the main output norm) of h_k, and it predicts t_{i+k+1}. The embedding E
and the head are the decoder's own; the loss adds `loss_weight / D` x the modules' mean
cross entropies to the next-token loss. A target is counted only where t_{i+k} and
t_{i+k+1} are in position i's document (packed rows) and inside the row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.layers import BaseLayer, CausalLM, Linear, RMSNorm, TransformerLayer, cross_entropy
from axplug.api.sharding import constrain

__all__ = ["MTPModule", "MultiTokenPredictionLM", "shifted"]


class MTPModule(BaseLayer):
    """One prediction depth: norms of the token embedding and of the previous hidden states,
    their concatenation projected back to `dim` (`eh_proj`), a transformer `block`, and a
    final norm (`post_norm`; DeepSeek-V3's `shared_head.norm`)."""

    @config_class
    class Config(BaseLayer.Config):
        dim: Required[int] = REQUIRED
        norm: BaseLayer.Config = RMSNorm.default_config()
        eh_proj: Linear.Config = Linear.default_config().set(mesh_axes=(None, "embed"))
        block: BaseLayer.Config = TransformerLayer.default_config()

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        for name in ("enorm", "hnorm", "post_norm"):
            self._add_child(name, cfg.norm.clone(input_dim=cfg.dim))
        self._add_child("eh_proj", cfg.eh_proj.clone(input_dim=2 * cfg.dim, output_dim=cfg.dim))
        self._add_child("block", cfg.block.clone(input_dim=cfg.dim))

    def forward(self, embedded, hidden, *, positions, segment_ids=None):
        x = jnp.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1)
        x = self.block(self.eh_proj(x), positions=positions, segment_ids=segment_ids)
        return self.post_norm(x)


def shifted(x: jax.Array, k: int, fill) -> jax.Array:
    """x[:, i + k] at i ([batch, seq, ...]), `fill` past the row's end."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


class MultiTokenPredictionLM(CausalLM):
    """A `CausalLM` trained with `depth` multi-token-prediction modules (children `mtp0`,
    `mtp1`, ...) beside its next-token loss: loss = next-token + `loss_weight` / depth x
    sum of the modules' losses; `mtp/loss_k` is logged per depth. Prediction and decoding
    use the decoder alone; `export-hf` writes the modules too (DeepSeek-V3's layout)."""

    @config_class
    class Config(CausalLM.Config):
        depth: int = 1
        loss_weight: float = 0.3
        module: MTPModule.Config = MTPModule.default_config()

    # An export writes the modules beside the model (DeepSeek-V3's layers past the last):
    # the same role as a CausalLM's, the module options outside config.json's fields.
    hf_role = "causal_lm"
    hf_neutral = ("depth", "loss_weight", "module")

    @classmethod
    def folded_config(cls, cfg: CausalLM.Config) -> CausalLM.Config:
        """Kept whole (not a CausalLM): its modules are weights an export writes too."""
        return cfg

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.depth < 1:
            raise ConfigError(f"{self.path}.depth: {cfg.depth} must be >= 1")
        if not cfg.loss_weight >= 0:
            raise ConfigError(f"{self.path}.loss_weight: {cfg.loss_weight} must be >= 0")
        for k in range(cfg.depth):
            self._add_child(f"mtp{k}", cfg.module.clone(dim=cfg.decoder.dim))

    def predict_ahead(self, input_ids, *, positions=None, segment_ids=None):
        """(next-token logits [batch, seq, vocab], [depth] logits alike: depth k's at
        position i predict t_{i+k+1}, from t_{i+k}; past the row's end they read token 0)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]), input_ids.shape)
        hidden = self.decoder.output_norm(
            self.decoder.hidden_states(input_ids, positions=positions, segment_ids=segment_ids)
        )  # h_0: the main model's normed output, as transformers and vLLM feed the modules
        logits = constrain(self.decoder.project(hidden), ("batch", "seq", "vocab"))
        ahead = []
        for k in range(1, self._config.depth + 1):
            hidden = getattr(self, f"mtp{k - 1}")(
                self.decoder.embed(shifted(input_ids, k, 0), positions),
                hidden,
                positions=positions,
                segment_ids=segment_ids,
            )
            ahead.append(constrain(self.decoder.project(hidden), ("batch", "seq", "vocab")))
        return logits, ahead

    def forward(self, input_ids, target_labels, *, positions=None, segment_ids=None):
        cfg = self._config
        if self.decoder.fuses_loss:
            raise ConfigError(
                f"{self.path}: multi-token prediction needs the stack's hidden states, which "
                "a 1f1b or zbh1 pipeline keeps inside its schedule; use schedule=gpipe"
            )
        labels = constrain(target_labels, ("batch", "seq"))
        logits, ahead = self.predict_ahead(input_ids, positions=positions, segment_ids=segment_ids)
        loss, count = cross_entropy(logits, labels)
        self.add_summary("next_token_loss", loss)
        extra = jnp.zeros((), jnp.float32)
        for k, depth_logits in enumerate(ahead, start=1):
            mtp_loss, _ = cross_entropy(depth_logits, mtp_labels(labels, segment_ids, k))
            self.add_summary(f"mtp/loss_{k}", mtp_loss)
            extra = extra + mtp_loss
        total = loss + cfg.loss_weight / cfg.depth * extra
        self.add_summary("loss", total)
        return total, {"logits": logits, "num_tokens": count}


def mtp_labels(labels: jax.Array, segment_ids, k: int) -> jax.Array:
    """Depth k's targets: position i's label k tokens on (t_{i+k+1}), -1 where t_{i+k} or
    t_{i+k+1} lies past the row's end or outside position i's document."""
    out = shifted(labels, k, -1)  # -1 already where t_{i+k+1} leaves t_{i+k}'s document
    if segment_ids is not None:
        out = jnp.where(shifted(segment_ids, k, -1) == segment_ids, out, -1)
    return out
