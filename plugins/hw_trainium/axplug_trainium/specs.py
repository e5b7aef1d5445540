"""AWS Trainium chips: dense bf16 FLOP/s and HBM per chip (a chip holds several NeuronCores;
jax sees NeuronCores as devices, these figures and the rules count chips)."""

from __future__ import annotations

from axplug.api import DeviceSpec

__all__ = ["TRN1", "TRN2", "SPECS"]

GB = 10**9

# AWS EC2 Trn1 page and Neuron docs (Trainium architecture): trn1.32xlarge = 16 Trainium chips,
# 3,040 TFLOPS FP16/BF16 (190 per chip), 512 GB HBM (32 per chip), NeuronLink-v2, 800 Gbps EFA.
TRN1 = DeviceSpec(
    name="AWS Trainium (trn1)",
    platform="neuron",
    peak_bf16_flops=190e12,
    hbm_bytes=32 * GB,
    chips_per_host=16,
    interconnect="NeuronLink-v2 ring within trn1.32xlarge; 800 Gbps EFA (1600 on trn1n)",
    source="AWS EC2 Trn1 instances page; AWS Neuron docs, Trainium architecture",
)
# AWS Neuron docs (Trainium2 architecture): 667 TFLOPS dense BF16 and 96 GiB HBM per chip;
# trn2.48xlarge = 16 chips, NeuronLink-v3 2D torus, 3.2 Tbps EFA.
TRN2 = DeviceSpec(
    name="AWS Trainium2 (trn2)",
    platform="neuron",
    peak_bf16_flops=667e12,
    hbm_bytes=96 * 2**30,
    chips_per_host=16,
    interconnect="NeuronLink-v3 2D torus within trn2.48xlarge; 3.2 Tbps EFA v3",
    source="AWS Neuron docs, Trainium2 architecture; AWS EC2 Trn2 instances page",
)

SPECS = {"trn1": TRN1, "trn2": TRN2}
