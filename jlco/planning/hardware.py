"""Accelerator profiles as data: memory, bandwidths and dense peak rates, with sources.

The planner (`jlco.planning.memory`) and the simulator (`jlco.planning.throughput`) read these numbers; nothing else
about a chip is assumed anywhere. Values are the public spec-sheet figures. NVIDIA sheets
quote tensor-core rates "with sparsity"; the numbers here are the dense rates (half of
those). Every value keeps the document it came from next to it, and says so where a figure
is not published by the vendor (then it is an estimate and the source string says why).

Units: memory in decimal GB as the vendor states it (`hbm_bytes` converts), bandwidth in
GB/s (1e9 B/s) per direction, compute in TFLOP/s (1e12 FLOP/s).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sourced:
    """One figure and the public document it is taken from."""
    value: float
    source: str


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator. `fp8_tflops` equals `bf16_tflops` where the chip has no fp8 MXU /
    tensor-core path (fp8 weights are then upcast and run at the bf16 rate)."""
    name: str
    hbm_gb: Sourced
    hbm_gbps: Sourced
    bf16_tflops: Sourced
    fp8_tflops: Sourced
    host_link_gbps: Sourced
    runtime_reserve_gb: Sourced

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb.value * 1e9

    @property
    def hbm_gib(self) -> float:
        return self.hbm_bytes / 2**30

    @property
    def hbm_bw(self) -> float:
        """HBM bandwidth in bytes/s."""
        return self.hbm_gbps.value * 1e9

    @property
    def host_bw(self) -> float:
        """Host link bandwidth per direction in bytes/s."""
        return self.host_link_gbps.value * 1e9

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for matmuls whose inputs are `dtype` ('fp8' or 'bf16')."""
        if dtype == "fp8":
            return self.fp8_tflops.value * 1e12
        if dtype == "bf16":
            return self.bf16_tflops.value * 1e12
        raise ValueError(f"dtype={dtype!r} is invalid: allowed 'fp8', 'bf16'")

    def as_dict(self) -> dict:
        out = {"name": self.name}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Sourced):
                out[f.name] = {"value": v.value, "source": v.source}
        return out


_PCIE5 = "PCIe Gen5 x16: 64 GB/s per direction raw (PCI-SIG PCIe 5.0 base spec, 32 GT/s x16)"


def _pcie5_gpu(sheet: str) -> Sourced:
    return Sourced(64.0, f"{sheet} lists PCIe Gen5 x16; {_PCIE5}")


_GPU_RESERVE = Sourced(6.0, "estimate, not a vendor figure: CUDA context ~0.5-1 GB, cuBLAS/"
                       "XLA workspaces, all-to-all (EP) communication buffers ~2-4 GB")
_TPU_RESERVE = Sourced(1.5, "estimate, not a vendor figure: XLA runtime + scratch on TPU")
_TPU_HOST = ("Google does not publish per-chip host DMA bandwidth; assumed: host PCIe "
             "Gen4 x16 (~32 GB/s/dir) shared by the chips of one host -> per chip ")

_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100), SXM"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU product page (nvidia.com/en-us/data-center/h200), SXM"
_H800_SHEET = ("NVIDIA H800 SXM5 datasheet (China SKU; same tensor cores/HBM as H100 SXM, "
               "NVLink cut to 400 GB/s); DeepSeek-V3 tech report (arXiv 2412.19437) trains on it")
_H20_SHEET = ("NVIDIA HGX H20 spec as reported (no public nvidia.com datasheet; figures from "
              "press/analyst coverage, e.g. SemiAnalysis Nov 2023) - treat as approximate")
_B200_SHEET = ("NVIDIA HGX B200 spec table (nvidia.com/en-us/data-center/hgx), per GPU = "
               "board total / 8; early material said 192 GB, shipping parts 180 GB")

HARDWARE: dict[str, HardwareProfile] = {
    "h20": HardwareProfile(
        "H20", Sourced(96, _H20_SHEET), Sourced(4000, _H20_SHEET),
        Sourced(148, _H20_SHEET + "; dense BF16"), Sourced(296, _H20_SHEET + "; dense FP8"),
        _pcie5_gpu(_H20_SHEET), _GPU_RESERVE),
    "h800": HardwareProfile(
        "H800 SXM", Sourced(80, _H800_SHEET), Sourced(3350, _H800_SHEET),
        Sourced(989, _H800_SHEET + "; 1979 with sparsity -> 989 dense"),
        Sourced(1979, _H800_SHEET + "; 3958 with sparsity -> 1979 dense"),
        _pcie5_gpu(_H800_SHEET), _GPU_RESERVE),
    "h100": HardwareProfile(
        "H100 SXM", Sourced(80, _H100_SHEET), Sourced(3350, _H100_SHEET),
        Sourced(989, _H100_SHEET + "; 1979 with sparsity -> 989 dense"),
        Sourced(1979, _H100_SHEET + "; 3958 with sparsity -> 1979 dense"),
        _pcie5_gpu(_H100_SHEET), _GPU_RESERVE),
    "h200": HardwareProfile(
        "H200 SXM", Sourced(141, _H200_SHEET), Sourced(4800, _H200_SHEET),
        Sourced(989, _H200_SHEET + "; 1979 with sparsity -> 989 dense"),
        Sourced(1979, _H200_SHEET + "; 3958 with sparsity -> 1979 dense"),
        _pcie5_gpu(_H200_SHEET), _GPU_RESERVE),
    "b200": HardwareProfile(
        "B200", Sourced(180, _B200_SHEET), Sourced(8000, _B200_SHEET + "; 64 TB/s per board"),
        Sourced(2250, _B200_SHEET + "; 4.5 PF with sparsity per GPU -> 2.25 PF dense"),
        Sourced(4500, _B200_SHEET + "; 9 PF with sparsity per GPU -> 4.5 PF dense"),
        Sourced(64.0, _B200_SHEET + "; host side of HGX B200 hosts is PCIe Gen5 x16 (B200 "
                "itself is Gen6-capable; uncertain for a given server). " + _PCIE5),
        _GPU_RESERVE),
    "tpu_v5e": HardwareProfile(
        "TPU v5e", Sourced(16, "cloud.google.com/tpu/docs/v5e: 16 GB HBM2 per chip"),
        Sourced(819, "cloud.google.com/tpu/docs/v5e: 819 GB/s"),
        Sourced(197, "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16"),
        Sourced(197, "cloud.google.com/tpu/docs/v5e: no fp8 MXU (int8 394 TOPS); fp8 runs "
                "at the bf16 rate"),
        Sourced(16, _TPU_HOST + "~16 GB/s (estimate)"), _TPU_RESERVE),
    "tpu_v5p": HardwareProfile(
        "TPU v5p", Sourced(95, "cloud.google.com/tpu/docs/v5p: 95 GB HBM2e per chip"),
        Sourced(2765, "cloud.google.com/tpu/docs/v5p: 2765 GB/s"),
        Sourced(459, "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16"),
        Sourced(459, "cloud.google.com/tpu/docs/v5p: no fp8 MXU (int8 918 TOPS); fp8 runs "
                "at the bf16 rate"),
        Sourced(16, _TPU_HOST + "~16 GB/s (estimate)"), _TPU_RESERVE),
    "tpu_v6e": HardwareProfile(
        "TPU v6e (Trillium)", Sourced(32, "cloud.google.com/tpu/docs/v6e: 32 GB HBM per chip"),
        Sourced(1640, "cloud.google.com/tpu/docs/v6e: 1640 GB/s"),
        Sourced(918, "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16"),
        Sourced(918, "cloud.google.com/tpu/docs/v6e: no fp8 MXU listed (int8 1836 TOPS); fp8 "
                "runs at the bf16 rate"),
        Sourced(16, _TPU_HOST + "~16 GB/s (estimate)"), _TPU_RESERVE),
}


def get_hardware(name: str) -> HardwareProfile:
    """Look a profile up by key (case-insensitive; 'v5e' etc. also accepted)."""
    key = name.lower().replace("-", "_")
    if key in ("v5e", "v5p", "v6e"):
        key = "tpu_" + key
    if key not in HARDWARE:
        raise ValueError(f"hardware={name!r} is invalid: allowed one of {', '.join(HARDWARE)}")
    return HARDWARE[key]
