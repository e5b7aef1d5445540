"""Google Cloud TPU chips: bf16 peak FLOP/s and HBM per chip."""

from __future__ import annotations

from axplug.api import DeviceSpec

__all__ = ["V4", "V5E", "V5P", "V6E", "SPECS"]

GIB = 2**30
_DOCS = "Google Cloud TPU docs, system architecture page for "

# 275 TFLOPS bf16, 32 GiB HBM2, 4 chips per host, 3D torus ICI (pods of 4096).
V4 = DeviceSpec(
    name="TPU v4",
    platform="tpu",
    peak_bf16_flops=275e12,
    hbm_bytes=32 * GIB,
    chips_per_host=4,
    interconnect="ICI 3D torus, 4096-chip pods; DCN across slices",
    source=_DOCS + "TPU v4",
)
# 197 TFLOPS bf16, 16 GiB HBM2, up to 8 chips per host, 2D torus ICI (slices up to 256).
V5E = DeviceSpec(
    name="TPU v5e",
    platform="tpu",
    peak_bf16_flops=197e12,
    hbm_bytes=16 * GIB,
    chips_per_host=8,
    interconnect="ICI 2D torus 1600 Gbps, slices up to 256 chips; DCN across slices",
    source=_DOCS + "TPU v5e",
)
# 459 TFLOPS bf16, 95 GiB HBM2e, 4 chips per host, 3D torus ICI 4800 Gbps (pods of 8960).
V5P = DeviceSpec(
    name="TPU v5p",
    platform="tpu",
    peak_bf16_flops=459e12,
    hbm_bytes=95 * GIB,
    chips_per_host=4,
    interconnect="ICI 3D torus 4800 Gbps, 8960-chip pods; DCN across slices",
    source=_DOCS + "TPU v5p",
)
# Trillium: 918 TFLOPS bf16, 32 GiB HBM, up to 8 chips per host, 2D torus ICI 3584 Gbps.
V6E = DeviceSpec(
    name="TPU v6e",
    platform="tpu",
    peak_bf16_flops=918e12,
    hbm_bytes=32 * GIB,
    chips_per_host=8,
    interconnect="ICI 2D torus 3584 Gbps, slices up to 256 chips; DCN across slices",
    source=_DOCS + "TPU v6e (Trillium)",
)

SPECS = {"v4": V4, "v5e": V5E, "v5p": V5P, "v6e": V6E}
