"""Pipeline parallelism over a scanned layer stack: stages on the `pipeline` mesh axis."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from axplug.api import ParameterSpec
from axplug.api.config import ConfigError, config_class
from axplug.api.layers import (
    RESIDUAL_AXES,
    OutputCollection,
    RepeatedTransformer,
    merge_collections,
    scan_layer,
)
from axplug.api.sharding import (
    PIPELINE_AXIS,
    ShardingScope,
    constrain,
    current_scope,
    scoped,
    sharding_scope,
)
from axplug_pipeline.one_f_one_b import (
    SELF_DIFFERENTIATED,
    masked,
    one_f_one_b,
    schedule_table,
    table_bubble,
)

__all__ = ["PipelinedTransformer", "PIPELINE_SCHEDULES", "bubble_fraction", "format_schedule"]

PIPELINE_SCHEDULES = ("gpipe", "circular", *SELF_DIFFERENTIATED)
STAGE_AXIS = "stage"  # logical axis of the stage dimension; the rules map it to `pipeline`


def bubble_fraction(
    stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe"
) -> float:
    """The share of stage-iterations that are idle: (S - 1) / (M V + S - 1); with `1f1b` and
    `zbh1`, from their schedule table (`one_f_one_b.table_bubble`): (S - 1) / (M + S - 1) and
    (2S - 2) / (3M + 2S - 2)."""
    if schedule in SELF_DIFFERENTIATED:
        return table_bubble(schedule, stages, microbatches)
    return (stages - 1) / (microbatches * repeats + stages - 1)


def format_schedule(schedule: str, stages: int, microbatches: int, width: int = 24) -> str:
    """The schedule table as text: a row per stage, a column per tick (the first `width`),
    each cell the slots the stage runs with their microbatch (`F3`, `Bi1`, `W0`)."""
    table = schedule_table(schedule, stages, microbatches)[:width]
    cells = [
        [" ".join(f"{k}{m}" for k, m in row[s]) or "." for row in table] for s in range(stages)
    ]
    size = max(len(c) for row in cells for c in row)
    lines = [f"stage {s}: " + " ".join(c.ljust(size) for c in row) for s, row in enumerate(cells)]
    more = len(schedule_table(schedule, stages, microbatches)) - width
    return "\n".join(lines) + (f"\n(... {more} more ticks)" if more > 0 else "")


class PipelinedTransformer(RepeatedTransformer):
    """A RepeatedTransformer whose layers run as `num_stages` pipeline stages.

    The parameters are RepeatedTransformer's tree ([num_layers, ...] per leaf, so checkpoints
    move between pipelined and scanned runs unchanged), with the layer axis split over the
    `pipeline` mesh axis. The batch is cut into `num_microbatches`; one `lax.scan` over
    M * V + S - 1 iterations runs every stage on its microbatch at once (a `vmap` over stages
    that the partitioner places one stage per `pipeline` device) and shifts the stage outputs
    one stage on (a collective permute). `circular` gives each device `num_repeats` virtual
    stages (layers s, S + s, 2S + s, ... chunks), cutting the bubble by that factor; its
    stage-major regrouping of the layer axis moves (V - 1) / V of the weights between
    devices each step. Autodiff runs the same iterations backwards (all forwards, then all
    backwards, as GPipe); `remat_policy` applies per layer inside each stage. `1f1b` and
    `zbh1` (zero-bubble: input and weight gradients split, the weights' filling the bubble)
    train through `forward_with_loss` instead (axplug_pipeline.one_f_one_b), their forward
    pass in evaluation and decoding is GPipe's.
    """

    @config_class
    class Config(RepeatedTransformer.Config):
        num_stages: int = 2
        num_microbatches: int = 2
        schedule: str = "gpipe"
        num_repeats: int = 2  # virtual stages per device with `circular`

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        S, M, V = cfg.num_stages, cfg.num_microbatches, self.repeats
        where = self.path
        if cfg.schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"{where}.schedule: unknown schedule {cfg.schedule!r}; choose from "
                f"{list(PIPELINE_SCHEDULES)}"
            )
        if S < 1 or M < 1 or V < 1:
            raise ConfigError(f"{where}: num_stages, num_microbatches and num_repeats must be >= 1")
        if cfg.num_layers % (S * V):
            raise ConfigError(
                f"{where}: num_layers={cfg.num_layers} does not split into {S} stages x {V} "
                f"repeats; use a stage count that divides the layers"
            )
        if cfg.schedule == "circular" and M < S:
            raise ConfigError(
                f"{where}: the circular schedule needs num_microbatches ({M}) >= num_stages "
                f"({S}), so a microbatch's output is back before its next repeat starts"
            )

    @property
    def repeats(self) -> int:
        cfg = self._config
        return cfg.num_repeats if cfg.schedule == "circular" else 1

    @property
    def bubble(self) -> float:
        cfg = self._config
        return bubble_fraction(cfg.num_stages, cfg.num_microbatches, self.repeats, cfg.schedule)

    def pipeline_summary(self) -> dict[str, Any]:
        """What `axplug aot` reports of this stack."""
        cfg = self._config
        summary = {
            "stages": cfg.num_stages,
            "microbatches": cfg.num_microbatches,
            "schedule": cfg.schedule,
            "repeats": self.repeats,
            "bubble": self.bubble,
        }
        if cfg.schedule in SELF_DIFFERENTIATED:
            S, M = cfg.num_stages, cfg.num_microbatches
            summary["table"] = format_schedule(cfg.schedule, S, M)
            summary["bubble_1f1b"] = table_bubble("1f1b", S, M)
        return summary

    def create_parameter_specs_recursively(self) -> dict[str, Any]:
        specs = super().create_parameter_specs_recursively()
        return jax.tree.map(
            lambda s: dataclasses.replace(s, mesh_axes=(STAGE_AXIS, *s.mesh_axes[1:])),
            specs,
            is_leaf=lambda s: isinstance(s, ParameterSpec),
        )

    def _stage_params(self, params: Any) -> Any:
        """[L, ...] leaves -> [S, V, L / (S V), ...], stage s holding virtual stages s, S + s..."""
        cfg = self._config
        S, V = cfg.num_stages, self.repeats
        inner = self.layer.create_parameter_specs_recursively()

        def regroup(leaf, spec):
            per = cfg.num_layers // (S * V)
            x = leaf.reshape(V, S, per, *leaf.shape[1:]).swapaxes(0, 1)
            return constrain(x, (STAGE_AXIS, None, "layers", *spec.mesh_axes))

        return jax.tree.map(regroup, params, inner, is_leaf=lambda s: isinstance(s, ParameterSpec))

    @property
    def fuses_loss(self) -> bool:
        """Whether training calls `forward_with_loss` (1F1B and ZB-H1 need the loss in the
        pipeline)."""
        return self._config.schedule in SELF_DIFFERENTIATED

    def _setup(self, x: jax.Array, kwargs: dict) -> _Pipeline:
        cfg = self._config
        S, M, V = cfg.num_stages, cfg.num_microbatches, self.repeats
        ctx = self._context()
        layer_ctx = ctx.add_child("layer")
        batch = x.shape[0]
        if batch % M:
            raise ConfigError(
                f"{self.path}.num_microbatches={M} does not divide the batch of {batch} rows"
            )
        per = cfg.num_layers // (S * V)
        scope = current_scope()
        inner = None
        if scope is not None and scope.mesh.shape.get(PIPELINE_AXIS, 1) > 1:
            inner = _without_pipeline(scope)

        def whole(a, axes):
            # Every stage reads and writes the microbatches: keep them on every stage's
            # devices (split by the data axes only) rather than spread over the stages.
            with sharding_scope(inner if inner is not None else scope):
                return constrain(a, axes)

        def microbatches(a, axes):
            # Microbatch m is rows m, M + m, 2M + m, ...: each keeps the data sharding.
            a = whole(a, axes)
            return whole(a.reshape(batch // M, M, *a.shape[1:]).swapaxes(0, 1), (None, *axes))

        base_key = layer_ctx.prng_key if layer_ctx.has_prng_key else None
        policy = cfg.remat_policy

        def run_stage(stage_params, h, stage, repeat, micro, stage_extras):
            layer_params = jax.tree.map(lambda p: p[repeat], stage_params)
            keys = None
            if base_key is not None:  # a key per (layer, microbatch)
                first = (repeat * S + stage) * per
                keys = jax.vmap(
                    lambda i: jax.random.fold_in(jax.random.fold_in(base_key, first + i), micro)
                )(jnp.arange(per))
            return scan_layer(
                self.layer, layer_params, h, stage_extras, keys, ctx.is_training, policy
            )

        if inner is not None:
            run_stage = scoped(run_stage, inner)
        return _Pipeline(
            S=S,
            M=M,
            V=V,
            per=per,
            layer_ctx=layer_ctx,
            whole=whole,
            extras={
                k: microbatches(v, ("batch", "seq")) for k, v in kwargs.items() if v is not None
            },
            xs=microbatches(x, RESIDUAL_AXES),
            labels=lambda a: microbatches(a, ("batch", "seq")),
            params=self._stage_params(layer_ctx.state),
            stages=jax.vmap(run_stage, spmd_axis_name=PIPELINE_AXIS if inner else None),
            unbatch=lambda a: whole(a.swapaxes(0, 1).reshape(x.shape), RESIDUAL_AXES),
        )

    def forward(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        p = self._setup(x, kwargs)
        S, M, V = p.S, p.M, p.V
        stage_ids = jnp.arange(S)

        def iteration(carry, t):
            state, io = carry
            k = t - stage_ids  # each stage's position in the microbatch x repeat order
            valid = (k >= 0) & (k < M * V)
            kc = jnp.clip(k, 0, M * V - 1)
            micro, repeat = kc % M, kc // M
            # Stage 0 reads the next microbatch (or a finished repeat) from `io`; stage s > 0
            # reads what stage s - 1 computed last iteration.
            first = jax.lax.dynamic_index_in_dim(io, t % M, keepdims=False)
            shifted = jnp.concatenate([first[None].astype(state.dtype), state[:-1]], axis=0)
            shifted = constrain(shifted, (STAGE_AXIS, *RESIDUAL_AXES))
            stage_extras = {k_: jnp.take(v, micro, axis=0) for k_, v in p.extras.items()}
            out, collection = p.stages(p.params, shifted, stage_ids, repeat, micro, stage_extras)
            collection = jax.tree.map(lambda c: masked(valid, c), collection)
            out = constrain(out, (STAGE_AXIS, *RESIDUAL_AXES))
            done = t - (S - 1)  # the microbatch x repeat the last stage just finished
            slot = jnp.clip(done, 0, M * V - 1) % M
            io = jnp.where(
                done >= 0,
                jax.lax.dynamic_update_index_in_dim(io, out[S - 1], slot, axis=0),
                io,
            )
            return (out, p.whole(io, (None, *RESIDUAL_AXES))), collection

        io = p.xs  # the inputs, then each repeat's outputs
        state = jnp.zeros((S, *io.shape[1:]), x.dtype)
        (_, io), collections = jax.lax.scan(iteration, (state, io), jnp.arange(M * V + S - 1))
        merge_collections(p.layer_ctx.output_collection, _per_layer(collections, M, S, V, p.per))
        return p.unbatch(io)

    def forward_with_loss(
        self,
        x: jax.Array,
        *,
        head: Callable[[Any, jax.Array, jax.Array], jax.Array],
        head_params: Any,
        labels: jax.Array,
        **kwargs: Any,
    ) -> jax.Array:
        """The summed loss of `head(head_params, stack output, labels)` over the microbatches,
        with its gradients from the 1F1B or ZB-H1 schedule (see `one_f_one_b`)."""
        p = self._setup(x, kwargs)
        if p.V != 1 or self._config.schedule not in SELF_DIFFERENTIATED:
            raise ConfigError(
                f"{self.path}: forward_with_loss runs the {'/'.join(SELF_DIFFERENTIATED)} "
                "schedules only"
            )
        stage_ids, first_repeat = jnp.arange(p.S), jnp.zeros(p.S, jnp.int32)

        def stage_fn(params, h, micro, stage_extras):
            return p.stages(params, h, stage_ids, first_repeat, micro, stage_extras)

        _check_no_outputs(self.path, stage_fn, p.params, p.xs[0], p.extras)
        return one_f_one_b(
            lambda params, h, micro, ex: stage_fn(params, h, micro, ex)[0],
            head,
            params=p.params,
            head_params=head_params,
            xs=p.xs,
            labels=p.labels(labels),
            extras=p.extras,
            whole=p.whole,
            schedule=self._config.schedule,
        )


class _Pipeline(NamedTuple):
    """What one call of a pipelined stack needs: sizes, the microbatched inputs, the stages."""

    S: int
    M: int
    V: int
    per: int
    layer_ctx: Any
    whole: Callable
    extras: dict
    xs: jax.Array
    labels: Callable
    params: Any
    stages: Callable
    unbatch: Callable


def _check_no_outputs(path, stage_fn, params, x0, extras) -> None:
    """1F1B computes gradients itself: layer outputs (aux losses) would miss them."""
    S = jax.tree.leaves(params)[0].shape[0]
    h = jnp.broadcast_to(x0, (S, *x0.shape))
    ex = {k: jnp.broadcast_to(v[0], (S, *v.shape[1:])) for k, v in extras.items()}
    _, collection = jax.eval_shape(stage_fn, params, h, jnp.zeros(S, jnp.int32), ex)
    if collection.module_outputs or collection.state_updates:
        raise ConfigError(
            f"{path}.schedule: the layers record outputs or state updates (e.g. MoE aux "
            "losses), which the 1f1b and zbh1 schedules' own backward pass does not carry; "
            "use schedule=gpipe or circular"
        )


def _per_layer(
    collection: OutputCollection, microbatches: int, S: int, V: int, per: int
) -> OutputCollection:
    """[iterations, S, per, ...] outputs (zero where a stage idled) -> [L, ...], averaged over
    the microbatches, in layer order like RepeatedTransformer's."""

    def fold(x):
        # Each (stage, repeat) ran once per microbatch; iteration t ran repeat (t - s) // M.
        iterations = x.shape[0]
        t = jnp.arange(iterations)[:, None]
        k = t - jnp.arange(S)[None, :]
        repeat = jnp.clip(k, 0, microbatches * V - 1) // microbatches
        onehot = jax.nn.one_hot(repeat, V, dtype=x.dtype)  # [iterations, S, V]
        summed = jnp.einsum("tsv,ts...->vs...", onehot, x) / microbatches
        return summed.reshape(V * S * per, *x.shape[3:])

    return OutputCollection(*(jax.tree.map(fold, branch) for branch in collection))


def _without_pipeline(scope: ShardingScope) -> ShardingScope:
    """The scope a stage's layers run in: vmap over stages owns the `pipeline` axis."""

    def drop(axes):
        if axes is None or isinstance(axes, str):
            return None if axes == PIPELINE_AXIS else axes
        return tuple(a for a in axes if a != PIPELINE_AXIS) or None

    return ShardingScope(scope.mesh, tuple((name, drop(axes)) for name, axes in scope.rules))
