"""GPUs and interconnects the roofline cost model knows, with where each number comes from."""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    mem_bandwidth: float  # HBM bytes/s
    memory_bytes: float
    link_bandwidth: float  # NVLink bytes/s per direction, per GPU
    link_latency_s: float  # per all-reduce call (launch + sync), a typical NCCL small-message figure
    pcie_bandwidth: float  # host <-> device bytes/s, for swapped KV blocks


# Sources (NVIDIA datasheets; "dense" = without 2:4 sparsity):
#  A100 80GB SXM: 312 TFLOPS bf16, 2,039 GB/s HBM2e, NVLink 3 600 GB/s total (300 GB/s each way), PCIe Gen4 x16 ~32 GB/s.
#  H100 80GB SXM: 989 TFLOPS bf16, 3.35 TB/s HBM3, NVLink 4 900 GB/s total (450 GB/s each way), PCIe Gen5 x16 ~64 GB/s.
#  H200 141GB SXM: 989 TFLOPS bf16, 4.8 TB/s HBM3e, NVLink 4 900 GB/s total, PCIe Gen5.
# The ~8 us all-reduce latency is the order of magnitude nccl-tests report for small messages on one NVLink node.
GPUS: dict[str, GPU] = {
    "a100": GPU("A100-80GB-SXM", 312e12, 2039e9, 80 * GiB, 300e9, 8e-6, 25e9),
    "h100": GPU("H100-80GB-SXM", 989e12, 3350e9, 80 * GiB, 450e9, 8e-6, 50e9),
    "h200": GPU("H200-141GB-SXM", 989e12, 4800e9, 141e9, 450e9, 8e-6, 50e9),
}


def get_gpu(name: str) -> GPU:
    key = name.lower().replace("-80gb", "").replace("_", "-")
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[key]
