"""Draft-model proposals: a smaller model of the same vocabulary decodes each row's next
tokens greedily in an Engine of its own, whose prefix cache keeps what it computed for a row's
context, so each step it computes only the tokens the target accepted since."""

from __future__ import annotations

from typing import Any

from axplug.api.config import config_class
from axplug.api.run import Engine, Proposer, Request, SamplingParams, load_checkpoint

__all__ = ["DraftProposer"]

PAGE_SIZE = 16


class DraftProposer(Proposer):
    """Proposes the greedy tokens of the draft model at `checkpoint` (an axplug run with the
    target's tokenizer), or of `draft` (a LoadedModel, from Python)."""

    @config_class
    class Config(Proposer.Config):
        checkpoint: str | None = None  # the draft's run directory
        step: int | None = None  # its checkpoint step (default: the latest)

    def __init__(self, cfg, *, draft: Any = None):
        super().__init__(cfg)
        type(self).check_config(cfg)
        if draft is None and cfg.checkpoint is None:
            raise cfg.field_error(
                "checkpoint", "name the draft model's run: draft:checkpoint=RUN_DIR[,num_tokens=4]"
            )
        self._draft = draft
        self.engine: Engine | None = None

    def bind(self, engine: Any) -> None:
        """The draft's own Engine, as many rows as the target's, with a paged cache."""
        cfg = self._config
        draft = self._draft
        if draft is None:
            modifiers = [f"paged_kv_cache:page_size={PAGE_SIZE}"]
            draft = load_checkpoint(cfg.checkpoint, step=cfg.step, modifiers=modifiers)
        if engine.vocab_size is not None and draft.vocab_size != engine.vocab_size:
            raise cfg.field_error(
                "checkpoint",
                f"the draft's vocabulary has {draft.vocab_size} tokens, the target's "
                f"{engine.vocab_size}: a draft must share the target's tokenizer",
            )
        self.engine = Engine(draft.model, draft.params, num_slots=engine.num_slots,
                             max_len=engine.max_len, max_logprobs=0)  # fmt: skip

    def propose(self, contexts: dict[int, list[int]], limits: dict[int, int]) -> dict[int, list]:
        if self.engine is None:
            raise RuntimeError("DraftProposer.propose before bind: give it to an Engine")
        ids = {
            row: self.engine.submit(Request(ctx, SamplingParams(max_new_tokens=limits[row],
                                                                temperature=0)))
            for row, ctx in contexts.items()
        }  # fmt: skip
        done = {c.id: c.output_ids for c in self.engine.run()}
        return {row: done[i] for row, i in ids.items()}
