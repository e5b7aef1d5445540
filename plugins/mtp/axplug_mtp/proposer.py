"""Speculative-decoding proposals from a model's multi-token-prediction modules: the main
model's greedy next token, then each module's greedy token after it (DeepSeek-V3's use of its
MTP module at inference), for the Engine to verify (`Engine(speculative="mtp:checkpoint=RUN")`,
`axplug serve --speculative mtp:checkpoint=RUN`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axplug.api.config import ConfigError, config_class
from axplug.api.layers import functional
from axplug.api.run import Proposer, load_checkpoint
from axplug_mtp.layer import MultiTokenPredictionLM

__all__ = ["MTPProposer"]


class MTPProposer(Proposer):
    """Proposes up to depth + 1 tokens a row from the MTP-trained run at `checkpoint` (or
    `model` and `params`, from Python). Each proposal reads the row's whole context again (no
    cache of its own): a pass for the main model's token, one more per module."""

    @config_class
    class Config(Proposer.Config):
        checkpoint: str | None = None  # an axplug run trained with --modifier mtp
        step: int | None = None  # its checkpoint step (default: the latest)

    def __init__(self, cfg, *, model: Any = None, params: Any = None):
        super().__init__(cfg)
        type(self).check_config(cfg)
        if model is None and cfg.checkpoint is None:
            raise cfg.field_error(
                "checkpoint", "name a run trained with --modifier mtp: mtp:checkpoint=RUN_DIR"
            )
        self._model, self._params = model, params
        self._predict: Any = None
        self._width = 0

    def bind(self, engine: Any) -> None:
        cfg = self._config
        if self._model is None:
            loaded = load_checkpoint(cfg.checkpoint, step=cfg.step)
            self._model, self._params = loaded.config.model.instantiate(parent=None), loaded.params
        model = self._model
        if not isinstance(model, MultiTokenPredictionLM):
            raise cfg.field_error(
                "checkpoint",
                f"{cfg.checkpoint or 'the model'} has no multi-token-prediction modules (a "
                f"{type(model).__name__}); train or import it with --modifier mtp",
            )
        vocab = model.config.decoder.vocab_size
        if engine.vocab_size is not None and vocab != engine.vocab_size:
            raise ConfigError(
                f"speculative.checkpoint: the MTP model's vocabulary has {vocab} tokens, the "
                f"target's {engine.vocab_size}: it must share the target's tokenizer"
            )
        # One program: every row padded to the longest context and drafts a row can have.
        self._width = engine.max_len + model.config.depth + 1

        def predict(params, ids):
            out, _ = functional(model, prng_key=None, state=params, inputs=(ids,),
                                is_training=False, method="predict_ahead")  # fmt: skip
            main, ahead = out
            return jnp.stack([main, *ahead]).argmax(-1)  # [depth + 1, rows, seq]

        self._predict = jax.jit(predict)

    def propose(self, contexts: dict[int, list[int]], limits: dict[int, int]) -> dict[int, list]:
        if self._predict is None:
            raise RuntimeError("MTPProposer.propose before bind: give it to an Engine")
        rows = sorted(contexts)
        drafts: dict[int, list[int]] = {r: [] for r in rows}
        steps = min(self._model.config.depth + 1, max(limits.values(), default=0))
        for d in range(steps):
            ids = np.zeros((len(rows), self._width), np.int32)
            for i, r in enumerate(rows):
                seq = contexts[r] + drafts[r]
                ids[i, : len(seq)] = seq
            greedy = np.asarray(self._predict(self._params, ids))
            for i, r in enumerate(rows):
                if len(drafts[r]) < limits[r]:
                    # Depth d's logits at the context's last position predict the d-th token
                    # after it, from the d drafts before it.
                    drafts[r].append(int(greedy[d, i, len(contexts[r]) - 1]))
        return drafts
