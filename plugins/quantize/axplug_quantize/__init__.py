"""Quantization for axplug: quantized training (the `quantized_linear` layer and the
`quantize` modifier) and weight-only int8 / fp8 for serving (`quantize_weights`)."""

from axplug_quantize.layer import QUANTIZE_MODES, QuantizedLinear, fp8_matmul, int8_matmul
from axplug_quantize.modifier import QuantizeModifier
from axplug_quantize.weights import WEIGHT_FORMATS, WeightOnlyLinear, quantize_weights

__all__ = ["QUANTIZE_MODES", "QuantizedLinear", "QuantizeModifier", "WEIGHT_FORMATS",
           "WeightOnlyLinear", "fp8_matmul", "int8_matmul", "quantize_weights"]  # fmt: skip
