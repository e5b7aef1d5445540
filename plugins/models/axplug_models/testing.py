"""The model-family kit: a family's import, decode and export against `transformers` itself.

`check_against_transformers(config, tmp_path)` builds a tiny random model with transformers
(every 1-d or constant weight perturbed, so a dropped bias, a norm convention or two norms
swapped show), saves it, runs `axplug import-hf` (with `modifiers`, e.g. `scan_layers`),
compares the last-position logits and 16 greedy tokens, runs `axplug export-hf` and reloads
the export with `AutoModelForCausalLM`. It lives in axplug-models, not the core, for its test
dependency (torch and transformers, this distribution's `test` extra).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["HFCheck", "tiny_transformers_model", "check_against_transformers"]

PROMPT = (3, 17, 42, 5, 28, 11, 60, 2, 9, 33, 21, 14)


@dataclasses.dataclass(frozen=True)
class HFCheck:
    """What `check_against_transformers` compared, for the test to assert on or report."""

    architecture: str
    logits_error: float  # max |axplug - transformers| of the last position's logits
    greedy_axplug: list[int]
    greedy_transformers: list[int]
    export_logits_error: float  # the exported model reloaded by transformers vs the original
    export_class: str
    run_dir: str
    hf_dir: str
    export_dir: str
    # The transformers model the check built (for a caller's further comparisons: no reload).
    reference: Any = dataclasses.field(default=None, repr=False, compare=False)

    def mismatches(self, tol: float = 1e-5) -> list[str]:
        """What fails the families' bar: logits off by more than `tol`, other greedy tokens,
        an export reloaded as another class or computing other logits; [] when all hold."""
        out = []
        if not self.logits_error < tol:
            out.append(f"logits off by {self.logits_error:.3g} (> {tol})")
        if self.greedy_axplug != self.greedy_transformers:
            out.append(f"greedy {self.greedy_axplug} != transformers' {self.greedy_transformers}")
        if self.export_class != self.architecture:
            out.append(f"the export reloads as {self.export_class}, not {self.architecture}")
        if not self.export_logits_error < tol:
            out.append(f"the export's logits off by {self.export_logits_error:.3g} (> {tol})")
        return out


def tiny_transformers_model(config: Any, *, seed: int = 0, scale: float = 0.1) -> Any:
    """`AutoModelForCausalLM.from_config(config)` in float32 with every 1-d or constant weight
    perturbed: the parameters and the buffers the checkpoint stores (DeepSeek's router bias)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train(False)
    saved = set(model.state_dict())
    stored_buffers = [b for name, b in model.named_buffers() if name in saved]
    with torch.no_grad():
        for param in [*model.parameters(), *stored_buffers]:
            if param.is_floating_point() and (param.ndim == 1 or _constant(param)):
                param.add_(torch.randn_like(param) * scale)
    return model


def _constant(param: Any) -> bool:
    """Whether every entry is the same: a norm's weight of any rank (Cohere's per-head q/k
    norms are [heads, head_dim] ones), which would hide two norms swapped."""
    return bool((param == param.reshape(-1)[0]).all())


def _hf_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _hf_greedy(model: Any, prompt: tuple[int, ...], steps: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.as_tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _cli(*args: str) -> None:
    from axplug_testing import run_cli

    result = run_cli(*args)
    if result.exit_code != 0:
        raise AssertionError(f"axplug {' '.join(args)} exited {result.exit_code}: {result.stderr}")


def check_against_transformers(
    config: Any,
    tmp_path: Any,
    *,
    steps: int = 16,
    prompt: tuple[int, ...] = PROMPT,
    modifiers: Sequence[str] = (),
) -> HFCheck:
    """Import (with `modifiers`, e.g. `scan_layers`), decode and export a tiny random model of
    `config` (a transformers config); the caller asserts on the returned errors (the families'
    bar: 1e-5 in float32)."""
    from transformers import AutoModelForCausalLM

    from axplug.api.run import SamplingParams, generate, load_checkpoint

    hf_dir, run_dir, export_dir = (os.path.join(str(tmp_path), d) for d in ("hf", "run", "out"))
    reference = tiny_transformers_model(config)
    reference.save_pretrained(hf_dir)
    ids = np.asarray([prompt], np.int32)  # int32 already: no conversion program to compile
    want = _hf_logits(reference, ids)[0, -1]
    flags = [arg for spec in modifiers for arg in ("--modifier", spec)]
    # On one device: a tiny import laid out over a test session's 8 fake devices costs twice.
    _cli("import-hf", hf_dir, "--output", run_dir, "--set", "mesh.mesh_shape=(1,1,1,1,1)", *flags)
    loaded = load_checkpoint(run_dir)
    got = loaded.logits(ids)[0, -1]
    (completion,) = generate(
        loaded.model,
        loaded.params,
        [list(prompt)],
        SamplingParams(max_new_tokens=steps, temperature=0.0),
    )
    _cli("export-hf", run_dir, "--output", export_dir)
    exported = AutoModelForCausalLM.from_pretrained(export_dir).train(False)
    again = _hf_logits(exported, ids)[0, -1]
    return HFCheck(
        architecture=type(reference).__name__,
        logits_error=float(np.max(np.abs(got - want))),
        greedy_axplug=list(completion.output_ids),
        greedy_transformers=_hf_greedy(reference, prompt, steps),
        export_logits_error=float(np.max(np.abs(again - want))),
        export_class=type(exported).__name__,
        run_dir=run_dir,
        hf_dir=hf_dir,
        export_dir=export_dir,
        reference=reference,
    )
