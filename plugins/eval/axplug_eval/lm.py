"""lm-evaluation-harness's model interface over the core's continuous-batching Engine.

Scoring requests are prompt-only engine requests (`max_new_tokens=0`, `prompt_logprobs`):
one prefill each, batched by the engine. Prompts are built as lm-eval's API models build them
(`TemplateLM._encode_pair`, left truncation to `max_length`), so a task scores the same here
as through `axplug serve` with lm-eval's `local-completions`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences

from axplug.api.run import Completion, Engine, Logprob, Request, SamplingParams

__all__ = ["EngineLM", "cut_at_stops"]

# Prompt tokens decoded with the output, as the server's text stream does, so a token's
# leading space comes out as in the full text.
_CONTEXT_TOKENS = 8


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(hits)] if hits else text


class EngineLM(TemplateLM):
    """An lm-eval model scoring and generating with `engine` and `tokenizer`.

    `stop_tokens` end generation (the model's EOS ids); `max_gen_toks` is the default new-token
    budget of a generation task; `batch_size` requests go to the engine at a time (it decodes
    `engine.num_slots` of them at once); `progress(done, total)` follows each batch.
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        *,
        stop_tokens: Sequence[int] = (),
        max_gen_toks: int = 256,
        batch_size: int = 64,
        progress: Callable[[int, int], None] | None = None,
    ):
        super().__init__()
        self.engine, self.tokenizer = engine, tokenizer
        self.stop_tokens = tuple(stop_tokens)
        self.max_length = engine.max_len
        self.max_gen_toks = max_gen_toks
        self.batch_size = max(1, batch_size)
        self._progress = progress or (lambda done, total: None)

    # -- tokenization, as lm-eval's API models with a remote tokenizer ----------------------

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is scored after: BOS, else EOS, else token 0."""
        for token in (self.tokenizer.bos_id, self.tokenizer.eos_id):
            if token is not None:
                return token
        return 0

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Iterable[int], **kwargs) -> str:
        return self.tokenizer.decode(list(tokens))

    # -- lm-eval's three request types ------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        prompts, context_lens = [], []
        for _, context_enc, continuation_enc in requests:
            whole = context_enc + continuation_enc
            prompts.append(whole[-self.max_length :])
            context_lens.append(len(context_enc) - max(0, len(whole) - self.max_length))
        scoring = SamplingParams(max_new_tokens=0, prompt_logprobs=0)
        results = []
        for completion, context_len in zip(self._run(prompts, scoring), context_lens, strict=True):
            # every token but the first has its log-probability (prompt_logprobs=0)
            scored = cast("list[Logprob]", completion.prompt_logprobs)[max(context_len, 1) :]
            total = sum(entry.logprob for entry in scored)
            results.append((total, all(entry.rank == 1 for entry in scored)))
        for request, result in zip(requests, results, strict=True):
            if request[0] is not None:  # not a window of a rolling request
                self.cache_hook.add_partial("loglikelihood", request[0], result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for i, (string,) in enumerate(request.args for request in requests):
            for window in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1,
                    context_len=1,
                ),
            ):
                windows.append((None, *window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        prompts, samplings, stops = [], [], []
        for context, gen_kwargs in (request.args for request in requests):
            kwargs = dict(gen_kwargs)
            default = kwargs.pop("max_tokens", self.max_gen_toks)
            max_gen_toks = int(kwargs.pop("max_gen_toks", default))
            until = handle_stop_sequences(kwargs.pop("until", None), eos)
            temperature = float(kwargs.pop("temperature", 0.0))
            if not kwargs.pop("do_sample", temperature > 0):
                temperature = 0.0
            prompts.append(self.tok_encode(context)[-(self.max_length - max_gen_toks) :])
            samplings.append(SamplingParams(
                max_new_tokens=max_gen_toks, temperature=temperature,
                top_p=float(kwargs.pop("top_p", 1.0)), top_k=int(kwargs.pop("top_k", 0)),
                stop_tokens=self.stop_tokens, seed=int(kwargs.pop("seed", 1234)),
            ))  # fmt: skip
            stops.append(until)
        out = []
        for completion, until in zip(self._run(prompts, samplings), stops, strict=True):
            context = completion.prompt_ids[-_CONTEXT_TOKENS:]
            skip = len(self.tokenizer.decode(context))
            text = self.tokenizer.decode(context + completion.output_ids)[skip:]
            out.append(cut_at_stops(text, until))
        for request, text in zip(requests, out, strict=True):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return out

    # -- the engine ----------------------------------------------------------------------

    def _run(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Completions of every prompt, in order, `batch_size` in the engine at a time."""
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        completions: list[Completion] = []
        for start in range(0, len(prompts), self.batch_size):
            batch = range(start, min(start + self.batch_size, len(prompts)))
            for i in batch:
                self.engine.submit(Request(prompts[i], samplings[i], id=i))
            done = {c.id: c for c in self.engine.run()}
            completions.extend(done[i] for i in batch)
            self._progress(len(completions), len(prompts))
        return completions
