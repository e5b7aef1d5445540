"""Pipeline parallelism for axplug: the `pipelined_transformer` stack, the `pipeline` modifier."""

from axplug_pipeline.layer import PIPELINE_SCHEDULES, PipelinedTransformer, bubble_fraction
from axplug_pipeline.modifier import PipelineModifier

__all__ = ["PIPELINE_SCHEDULES", "PipelinedTransformer", "PipelineModifier", "bubble_fraction"]
