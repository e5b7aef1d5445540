"""A vision-language model: a vision tower's projected features take the place of the image
placeholder tokens in a language model's (the core `Decoder`'s) input."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp

from axplug.api.config import REQUIRED, ConfigError, Required, config_class
from axplug.api.interop import (
    load_architecture,
    read_fields,
    registered_architectures,
    write_fields,
)
from axplug.api.layers import BaseLayer, Decoder, cross_entropy, side_inputs
from axplug_vision.projector import MLPProjector
from axplug_vision.tower import VisionTransformer

__all__ = [
    "VisionLanguageModel",
    "vision_fields",
    "placed_features",
    "text_architecture",
    "text_fields",
]


def text_architecture(model_type: Any) -> Any:
    """The installed text family whose model_type is `model_type`, or None."""
    name = _families().get(model_type)
    return None if name is None else load_architecture(name)


@functools.cache
def _families() -> dict[str, str]:
    """model_type -> installed architecture (each loaded once: an import and an export ask
    for the text family several times)."""
    names = registered_architectures()
    return {load_architecture(n).model_type: n for n in reversed(names)}


def text_fields(fields: Any, family: str | None = None) -> tuple[Any, Any]:
    """(the `text_config` fields read as its family reads them, that family or None); the
    family is the installed one of text_config's model_type, or `family`'s."""
    text = fields.raw.get("text_config")
    model_type = family or (text.get("model_type") if isinstance(text, dict) else None)
    arch = text_architecture(model_type)
    if arch is None:
        fields.problem(
            f"text_config.model_type={model_type!r}: no installed text family has it "
            "(`axplug list --kind architectures`)"
        )
        return fields.within("text_config"), None
    settings = dict(defaults=arch.defaults, aliases=arch.aliases, implied=arch.implied)
    return fields.within("text_config", **settings), arch


def vision_fields(fields: Any, tower: Any) -> Any:
    """The `vision_config` fields read as the tower's Hugging Face config class reads them
    (its defaults for the fields a published config leaves out, what its code fixes)."""
    vision = fields.raw.get("vision_config")
    kind = vision.get("model_type") if isinstance(vision, dict) else None
    settings = dict(
        defaults=getattr(tower.klass, "hf_defaults", {}).get(kind, {}),
        aliases=getattr(tower.klass, "hf_aliases", {}),
        implied=getattr(tower.klass, "hf_implied", {}),
    )
    return fields.within("vision_config", **settings)


def image_limits(mask: jax.Array, positions: jax.Array) -> jax.Array:
    """[batch, seq]: the causal limit of each token (`AttentionMask.q_causal_limits`), the
    position of the last token of its run of image tokens (`mask`), else its own position."""
    index = jnp.arange(mask.shape[1])
    following_text = jax.lax.cummin(jnp.where(mask, mask.shape[1], index), axis=1, reverse=True)
    last = jnp.take_along_axis(positions, jnp.clip(following_text - 1, 0), axis=1)
    return jnp.where(mask, last, positions)


def placed_features(input_ids: jax.Array, features: jax.Array, token: int) -> tuple:
    """(mask, embeddings [batch, seq, dim]): row b's placeholders (`token`) take the rows of
    `features[b]` [n, dim] in order (a placeholder past the n-th takes the last)."""
    mask = input_ids == token
    index = jnp.clip(jnp.cumsum(mask, axis=1) - 1, 0, features.shape[1] - 1)
    return mask, jnp.take_along_axis(features, index[..., None], axis=1)


class VisionLanguageModel(BaseLayer):
    """Token ids and images -> logits: `encode_images` runs the tower and the projector, and
    the features take the place of the `image_token_id` tokens (the core `Decoder`'s
    `inserted`). `pixel_values` [batch, images, channels, height, width] fill each row's
    placeholders in order; the loss is next-token cross entropy over labels >= 0.

    Hugging Face fields: the language model's from `text_config` (read as its family reads
    them), the tower's from `vision_config`, the projector's and the image token's from the
    top level. `vision_feature_layer` keeps the tower's layers up to that one (LLaVA's -2
    drops the last); an export writes the kept layers and -1."""

    hf_reads_subtree = True
    hf_writes_subtree = True

    @config_class
    class Config(BaseLayer.Config):
        decoder: Decoder.Config = Decoder.default_config()
        vision: BaseLayer.Config = VisionTransformer.default_config()
        # None: the tower's features are the decoder's width already (Qwen2.5-VL's merger).
        projector: BaseLayer.Config | None = MLPProjector.default_config()
        image_token_id: Required[int] = REQUIRED
        # The language model's family (`text_config.model_type`): its tensor names.
        text_model_type: str = "llama"
        # The installed text family that reads `text_config`, where its model_type is not
        # text_config's (Qwen2.5-VL's "qwen2_5_vl_text" is Qwen2's layout); None: the same.
        text_family: str | None = None
        # Drop the tower's class token from the features (LLaVA's "default" strategy).
        drop_class_token: bool = False
        # An image's tokens attend to each other both ways (Gemma 3); text stays causal.
        bidirectional_images: bool = False
        # The tokens around an image's placeholders (Gemma 3: <start_of_image>, <end_of_image>;
        # Qwen2.5-VL: <|vision_start|>, <|vision_end|>); None: none.
        image_begin_id: int | None = None
        image_end_id: int | None = None
        # Whether a prompt marks an image by the begin token alone, which the image's whole
        # sequence replaces with `image_text_around` outside it (Gemma 3's "\n\n"), rather
        # than by one placeholder between the begin and end tokens (Qwen2.5-VL's, LLaVA's).
        image_marked_by_begin: bool = False
        image_text_around: str = ""
        # Axes of the multimodal rotary positions (Qwen2.5-VL: 3, time, height, width): each
        # `Request.embeddings` vector carries its token's positions after its features, then
        # the offset of the text positions after it and whether it is an image's
        # (`prompts.rotary_embeddings`); 0: none.
        rope_axes: int = 0

    @classmethod
    def hf_read(cls, cfg: Config, fields) -> None:
        text, _ = text_fields(fields, cfg.text_family)
        read_fields(cfg.decoder, text)
        cfg.text_model_type = text.raw.get("model_type")
        read_fields(cfg.vision, vision_fields(fields, cfg.vision))
        if cfg.projector is not None:
            read_fields(cfg.projector, fields)
        cfg.image_token_id = fields.positive_int("image_token_id")
        strategy = fields.expect("vision_feature_select_strategy", "full", "default")
        cfg.drop_class_token = strategy == "default"
        layer, stack = fields.get("vision_feature_layer", -1), cfg.vision.transformer
        kept = stack.num_layers + 1 + layer if isinstance(layer, int) and layer < 0 else layer
        if not isinstance(kept, int) or not 0 < kept <= stack.num_layers:
            fields.problem(
                f"vision_feature_layer={layer!r} (one layer of the tower's "
                f"{stack.num_layers}, counted from -1 for the last)"
            )
        else:
            stack.num_layers = kept
        if bool(fields.get("tie_word_embeddings", False)) != cfg.decoder.tie_word_embeddings:
            fields.problem("tie_word_embeddings differs from text_config's")
        per_image = fields.get("image_seq_length", None)
        if per_image is not None and per_image != cls.tokens_per_image(cfg):
            fields.problem(
                f"image_seq_length={per_image!r}, but the tower and projector give "
                f"{cls.tokens_per_image(cfg)} features per image"
            )

    @classmethod
    def planning_inputs(cls, cfg: Config, batch: int, seq: int) -> dict:
        """The inputs a train step takes besides token ids, as (shape, dtype) for `axplug
        aot`: every token's share of its image's pixels (`image_pixels`)."""
        tower = cfg.vision
        pixels = tower.num_channels * tower.image_size**2
        per_image = cls.fixed_tokens_per_image(cfg)
        return {"image_pixels": ((batch, seq, pixels // per_image), "float32")}

    @classmethod
    def fixed_tokens_per_image(cls, cfg: Config) -> int:
        """`tokens_per_image`, which must not depend on the image (what images carried per
        token, in prepared data or a planned step, need)."""
        per_image = cls.tokens_per_image(cfg)
        if per_image is None:
            raise ConfigError(
                "the model's images take as many tokens as their size gives (Qwen2.5-VL's); "
                "images carried by their placeholder tokens need a tower of one image size"
            )
        return per_image

    @classmethod
    def tokens_per_image(cls, cfg: Config) -> int | None:
        """The features (placeholder tokens) of one image: a pooling projector's count (its
        `tokens_per_image`), else the tower's; None where images differ (Qwen2.5-VL's)."""
        pooled = getattr(cfg.projector, "tokens_per_image", None)
        if isinstance(pooled, int):
            return pooled
        tower = cfg.vision
        if not hasattr(tower, "image_size"):
            return None
        patches = (tower.image_size // tower.patch_size) ** 2
        # LLaVA's "default" drops the first token, a class token or (SigLIP) a patch.
        return patches + int(tower.class_token) - int(cfg.drop_class_token)

    @classmethod
    def hf_write(cls, cfg: Config) -> dict:
        text, problems = write_fields(cfg.decoder)
        arch = text_architecture(cfg.text_family or cfg.text_model_type)
        if arch is not None:  # as the core writes a text family's top level
            text = {**text, **arch.config_fields(cfg)}
            text = {arch.aliases.get(k, k): v for k, v in text.items()}
            text = {k: v for k, v in text.items() if k not in arch.implied}
        vision, more = write_fields(cfg.vision)
        aliases = getattr(cfg.vision.klass, "hf_aliases", {})
        vision = {aliases.get(k, k): v for k, v in vision.items()}
        projector, most = write_fields(cfg.projector) if cfg.projector else ({}, [])
        if problems or more or most:
            raise ValueError("; ".join(problems + more + most))
        per_image = cls.tokens_per_image(cfg)
        return {
            "text_config": {**text, "model_type": cfg.text_model_type},
            "vision_config": vision,
            **projector,
            "image_token_id": cfg.image_token_id,
            **({} if per_image is None else {"image_seq_length": per_image}),
            "tie_word_embeddings": cfg.decoder.tie_word_embeddings,
        }

    def __init__(self, cfg: Config, *, parent=None):
        super().__init__(cfg, parent=parent)
        self._add_child("decoder", cfg.decoder)
        self._add_child("vision", cfg.vision)
        if cfg.projector is not None:
            widths = dict(input_dim=cfg.vision.dim, output_dim=cfg.decoder.dim)
            self._add_child("projector", cfg.projector.clone(**widths))

    def encode_images(self, pixels: jax.Array, **vision_inputs) -> jax.Array:
        """[images, channels, height, width] -> features [images, tokens, decoder dim] (a
        tower that takes patches and their layout, Qwen2.5-VL's: [tokens, decoder dim])."""
        out = self.vision(pixels, **vision_inputs)
        hidden = out[0] if isinstance(out, tuple) else out  # a ViT's (hidden, pooled)
        if self._config.drop_class_token:
            hidden = hidden[:, 1:]
        return hidden if self._config.projector is None else self.projector(hidden)

    def pixels_from_tokens(self, input_ids: jax.Array, image_pixels: jax.Array) -> jax.Array:
        """[batch, images, channels, height, width] of a batch whose placeholder tokens carry
        their image (`image_pixels` [batch, seq, values]: each image's pixels flattened and
        split evenly over its placeholders, as prepared data stores them); a row holds up to
        seq / tokens_per_image images, the rest zeros."""
        cfg, (b, s) = self._config, input_ids.shape
        tower, per_image = cfg.vision, type(self).fixed_tokens_per_image(cfg)
        slots = -(-s // per_image) * per_image
        mask = input_ids == cfg.image_token_id
        index = jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, slots)
        rows = jnp.arange(b)[:, None]
        flat = jnp.zeros((b, slots, image_pixels.shape[-1]), image_pixels.dtype)
        flat = flat.at[rows, index].set(image_pixels, mode="drop")
        shape = (tower.num_channels, tower.image_size, tower.image_size)
        return flat.reshape(b, slots // per_image, *shape)

    def _inserted(self, input_ids, pixel_values, vision_inputs=None):
        if pixel_values is None:
            return None
        b = input_ids.shape[0]
        if vision_inputs is not None:  # the images as patches, laid out by the inputs
            features = self.encode_images(pixel_values, **vision_inputs)
        else:
            n = pixel_values.shape[1]
            features = self.encode_images(pixel_values.reshape(b * n, *pixel_values.shape[2:]))
        features = features.reshape(b, -1, features.shape[-1])
        return placed_features(input_ids, features, self._config.image_token_id)

    def _attending(self, inserted, positions, like: jax.Array, rope_positions=None):
        """The context the decoder runs in: image tokens' causal limits where bidirectional,
        multimodal rotary positions [batch, seq, axes] where given (Qwen2.5-VL's)."""
        side = {} if rope_positions is None else {"rope_positions": rope_positions}
        if inserted is not None and self._config.bidirectional_images:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(like.shape[1]), like.shape)
            side["causal_limits"] = image_limits(inserted[0], positions)
        return side_inputs(**side) if side else contextlib.nullcontext()

    def predict(self, input_ids, *, positions=None, segment_ids=None, pixel_values=None,
                vision_inputs=None, rope_positions=None):  # fmt: skip
        """Logits [batch, seq, vocab]; `vision_inputs` (a dict) go to the tower with the
        pixels, `rope_positions` [batch, seq, axes] to a multimodal rotary transform."""
        inserted = self._inserted(input_ids, pixel_values, vision_inputs)
        with self._attending(inserted, positions, input_ids, rope_positions):
            return self.decoder(
                input_ids, positions=positions, segment_ids=segment_ids, inserted=inserted
            )

    def forward(self, input_ids, target_labels, *, positions=None, segment_ids=None,
                pixel_values=None, image_pixels=None):  # fmt: skip
        """(loss, {"logits", "num_tokens"}) for next-token targets aligned with the inputs;
        images as `pixel_values`, or per placeholder token (`image_pixels`, prepared data)."""
        if image_pixels is not None:
            pixel_values = self.pixels_from_tokens(input_ids, image_pixels)
        inserted = self._inserted(input_ids, pixel_values)
        kwargs = dict(positions=positions, segment_ids=segment_ids, inserted=inserted)
        with self._attending(inserted, positions, input_ids):
            if self.is_training and self.decoder.fuses_loss:
                logits = None
                loss, count = self.decoder.fused_loss(input_ids, target_labels, **kwargs)
            else:
                logits = self.decoder(input_ids, **kwargs)
                loss, count = cross_entropy(logits, target_labels)
        self.add_summary("loss", loss)
        return loss, {"logits": logits, "num_tokens": count}

    def init_cache_state(self, batch_size: int, max_len: int) -> dict:
        """An empty decoding cache for `extend_step` (with multimodal rotary positions, each
        row's `position_offset` beside the decoder's, which an engine restarts with the row)."""
        cache = self.decoder.init_cache_state(batch_size, max_len)
        if not self._config.rope_axes:
            return cache
        return {"decoder": cache, "position_offset": jnp.zeros((batch_size,), jnp.int32)}

    def extend_step(self, input_ids, *, positions, cache_state, logits_at=None, inserted=None):
        """(logits, new cache) for new tokens after the cached ones; `inserted` (mask,
        embeddings) as `Decoder.extend_step` takes it (features from `encode_images`; with
        `rope_axes`, each vector then carries its token's rotary positions, see Config)."""
        rope, offset = None, None
        if self._config.rope_axes:
            inserted, rope, offset = self._rotary(inserted, positions, cache_state)
            cache_state = cache_state["decoder"]
        with self._attending(inserted, positions, input_ids, rope):
            logits, cache = self.decoder.extend_step(
                input_ids,
                positions=positions,
                cache_state=cache_state,
                logits_at=logits_at,
                inserted=inserted,
            )
        return logits, cache if offset is None else {"decoder": cache, "position_offset": offset}

    def _rotary(self, inserted, positions, cache_state):
        """(the features to insert, rotary positions [batch, new, axes], each row's offset):
        an image token takes the positions it carries; any other, its sequence position plus
        the offset the last image before it carries (the row's kept one before the first)."""
        axes, offset = self._config.rope_axes, cache_state["position_offset"]
        if inserted is None:
            shifted = positions + offset[:, None]
            return None, jnp.repeat(shifted[..., None], axes, axis=-1), offset
        mask, values = inserted
        dim = values.shape[-1] - axes - 2
        last = jax.lax.cummax(jnp.where(mask, jnp.arange(mask.shape[1]), -1), axis=1)
        after = jnp.take_along_axis(values[..., -2], jnp.maximum(last, 0), axis=1)
        after = jnp.where(last >= 0, after.astype(jnp.int32), offset[:, None])
        shifted = jnp.repeat((positions + after)[..., None], axes, axis=-1)
        carried = values[..., dim : dim + axes].astype(jnp.int32)
        rope = jnp.where(mask[..., None], carried, shifted)
        image = mask & (values[..., -1] > 0.5)
        return (image, values[..., :dim]), rope, after[:, -1]

    def prompt_with_images(self, params, ids, images, **options):
        """(expanded ids, `Request.embeddings`): see `axplug_vision.prompts.prompt_with_images`
        (the hook `axplug generate --image` and `axplug serve` call)."""
        from axplug_vision.prompts import prompt_with_images

        return prompt_with_images(self, params, ids, images, **options)

    def image_marker_text(self, tokenizer):
        """The text of one image in a prompt (`axplug_vision.prompts.image_marker_text`)."""
        from axplug_vision.prompts import image_marker_text

        return image_marker_text(self.config, tokenizer)
