"""Moved: `axplug aot` is a first-party plugin (axplug-aot); the names plugins imported
from here live in the core's public modules (plugin API 1.4). This path goes with API 2."""

from axplug.api.moved import moved_names

__getattr__ = moved_names(
    __name__,
    {
        **dict.fromkeys(("DeviceSpec", "with_device_spec"), "axplug.api"),
        **dict.fromkeys(
            ("device_spec_of", "detected_device_spec", "selector_device_count", "resolve_rule"),
            "axplug.mesh_rules",
        ),
        **dict.fromkeys(
            ("analytic_flops", "active_parameters", "model_flops_per_step"), "axplug.trainer"
        ),
    },
)
