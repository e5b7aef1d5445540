"""`DPOCausalLM`: a CausalLM trained on preference pairs (the same parameters, another loss)."""

from __future__ import annotations

import jax

from axplug.api.config import ConfigError, config_class
from axplug.api.layers import CausalLM
from axplug_dpo.loss import LOSSES, preference_loss, sequence_logps

__all__ = ["DPOCausalLM"]


class DPOCausalLM(CausalLM):
    """A `CausalLM` whose loss is a preference loss over rows that alternate chosen and
    rejected responses (`--input preferences`), the prompt tokens masked out.

    `reference_logps` (per target, from `axplug dpo-reference`) are the starting model's
    log-probabilities; SimPO needs none. Its parameters are the CausalLM's, so `train --from`,
    `generate`, `export-hf` and LoRA (`--modifier lora`) work unchanged; `dpo/*` metrics
    (reward margin, accuracy, chosen and rejected log-probabilities) are logged each step.
    """

    @config_class
    class Config(CausalLM.Config):
        beta: float = 0.1
        loss: str = "sigmoid"  # sigmoid (DPO), ipo, simpo
        simpo_gamma: float = 0.5

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        if cfg.loss not in LOSSES:
            raise ConfigError(f"{self.path}.loss: {cfg.loss!r}; choose from {LOSSES}")
        if cfg.beta <= 0:
            raise ConfigError(f"{self.path}.beta: must be > 0, got {cfg.beta}")

    def forward(
        self, input_ids, target_labels, *, reference_logps=None, positions=None, segment_ids=None
    ):
        cfg = self._config
        if input_ids.shape[0] % 2:
            raise ConfigError(
                f"{self.path}: {input_ids.shape[0]} rows; preference pairs need an even batch "
                "(chosen, rejected): use --input preferences"
            )
        if reference_logps is None and cfg.loss != "simpo":
            raise ConfigError(
                f"{self.path}: the batch has no reference_logps; run `axplug dpo-reference "
                "--checkpoint BASE DATA_DIR` on the preference data (or use loss=simpo)"
            )
        logits = self.decoder(input_ids, positions=positions, segment_ids=segment_ids)
        policy, counts = sequence_logps(logits, target_labels)
        reference = None if reference_logps is None else reference_logps.sum(axis=-1)
        loss, metrics = preference_loss(
            policy, reference, counts, beta=cfg.beta, kind=cfg.loss, simpo_gamma=cfg.simpo_gamma
        )
        for name, value in metrics.items():
            self.add_summary(f"dpo/{name}", jax.lax.stop_gradient(value))
        self.add_summary("loss", loss)
        return loss, {"logits": logits, "num_tokens": counts.sum()}
