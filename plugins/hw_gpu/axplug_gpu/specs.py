"""NVIDIA data-center GPUs: dense (no sparsity) bf16 Tensor Core FLOP/s and HBM per GPU (SXM)."""

from __future__ import annotations

from axplug.api import DeviceSpec

__all__ = ["A100", "H100", "H200", "B200", "SPECS"]

GB = 10**9
GIB = 2**30

# NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS (624 with sparsity),
# 80GB HBM2e (81920 MiB), NVLink 600 GB/s; DGX A100 / HGX A100 hold 8.
A100 = DeviceSpec(
    name="NVIDIA A100 80GB SXM",
    platform="gpu",
    peak_bf16_flops=312e12,
    hbm_bytes=80 * GIB,
    chips_per_host=8,
    interconnect="NVLink 3 600 GB/s per GPU in an 8-GPU NVSwitch node; InfiniBand across",
    source="NVIDIA A100 Tensor Core GPU datasheet",
)
# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS with sparsity, i.e.
# 989 dense; 80GB HBM3; NVLink 900 GB/s; DGX H100 / HGX H100 hold 8.
H100 = DeviceSpec(
    name="NVIDIA H100 80GB SXM",
    platform="gpu",
    peak_bf16_flops=989e12,
    hbm_bytes=80 * GIB,
    chips_per_host=8,
    interconnect="NVLink 4 900 GB/s per GPU in an 8-GPU NVSwitch node; 400 Gb/s IB per GPU",
    source="NVIDIA H100 Tensor Core GPU datasheet",
)
# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 1,979 TFLOPS with sparsity (989
# dense), 141GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; HGX H200 holds 8.
H200 = DeviceSpec(
    name="NVIDIA H200 141GB SXM",
    platform="gpu",
    peak_bf16_flops=989e12,
    hbm_bytes=141 * GB,
    chips_per_host=8,
    interconnect="NVLink 4 900 GB/s per GPU in an 8-GPU NVSwitch node",
    source="NVIDIA H200 Tensor Core GPU datasheet",
)
# NVIDIA DGX B200 datasheet: 8 B200, 1,440GB HBM3e in total (180GB each); HGX B200 FP16/BF16
# 4.5 PFLOPS per GPU with sparsity, i.e. 2.25 PFLOPS dense; NVLink 5 1.8 TB/s per GPU.
B200 = DeviceSpec(
    name="NVIDIA B200 180GB SXM",
    platform="gpu",
    peak_bf16_flops=2.25e15,
    hbm_bytes=180 * GB,
    chips_per_host=8,
    interconnect="NVLink 5 1.8 TB/s per GPU in an 8-GPU NVSwitch node",
    source="NVIDIA DGX B200 / HGX B200 datasheets",
)

SPECS = {"a100": A100, "h100": H100, "h200": H200, "b200": B200}
