"""Quantized training for axplug: the `quantized_linear` layer and the `quantize` modifier."""

from axplug_quantize.layer import QUANTIZE_MODES, QuantizedLinear, fp8_matmul, int8_matmul
from axplug_quantize.modifier import QuantizeModifier

__all__ = ["QUANTIZE_MODES", "QuantizedLinear", "QuantizeModifier", "fp8_matmul", "int8_matmul"]
