"""What a GPU offers the planner: usable bytes as the device reports them, and the margins outside the tracker.

Capacity is CUDA's total device memory (`torch.cuda.mem_get_info()[1]`, cudaDeviceProp.totalGlobalMem), not the
marketing size and not `nvidia-smi`'s memory.total, which also counts memory the driver keeps for itself: on the
H200 lent to this project CUDA reported 143,158 MiB where nvidia-smi said 143,771; an H100 80GB reports
81,082-81,090 MiB to CUDA (79.18 GiB; nvidia-smi: 81,559). The CUDA context comes out of CUDA's total (a margin
below, or the calibration). With a GPU present, `local_gpu()` reads it.

Margins are memory the step's tracked tensors do not include, each named in the planner's output:
- CUDA context and library handles (cuBLAS/cuDNN workspaces) outside PyTorch's allocator;
- NCCL communicator buffers, which depend on the topology (`NCCL_TOPOLOGIES`): per connected peer and channel
  NCCL keeps its protocol buffers (NCCL_BUFFSIZE, 4 MiB by default, plus LL/LL128), for every communicator the
  job uses (cp, dp, dp x cp, tp, pp); NVLink SHARP (NVLS) on NVSwitch systems adds multicast buffers that public
  reports put at 1.6-6 GB. The training job sets NCCL_NVLS_ENABLE=0 unless the user set it (all-to-all never
  uses NVLS; training/node_env.py), so the default topologies assume NVLS off; `nvswitch-nvls` is the
  conservative figure for a job that runs with it on, and the job's planner runs (the start-up U choice,
  memory.plan_check) take it when the environment turns NVLS on (`topology_for(..., nvls=True)`);
- allocator fragmentation: a fraction of the live peak (expandable_segments keeps it small).

These are stated margins with their uncertainty, not measurements. `tools/gpu_check.sh` measures the CUDA context
and fragmentation of one GPU into a calibration file (`CALIBRATION_FILE`); when that file exists for the planned GPU
model the planner uses its figures instead (NCCL across 8 or 16 GPUs cannot be measured on one and keeps its stated
topology margin).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
CALIBRATION_FILE = Path(__file__).resolve().parents[2] / "examples" / "plans" / "gpu_calibration.json"


@dataclass(frozen=True)
class GPU:
    name: str
    total_bytes: int  # CUDA's total device memory
    source: str  # where the figure comes from


# CUDA's total device memory of the GPUs our users train on (the lowest figure seen where it varies by driver).
GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("h100-80gb", 81082 * MIB, "CUDA total of H100 80GB HBM3 as torch prints it in public logs: 81,082-81,090 "
                                  "MiB (nvidia-smi: 81,559)"),
    GPU("h200", 150109880320, "torch.cuda.mem_get_info on the H200 lent here, driver 580.159.04: 143,158 MiB "
                              "(nvidia-smi: 143,771; docs/gpu_results.md)"),
    GPU("a100-80gb", (81920 - 613) * MIB, "nvidia-smi's 81,920 MiB less 613 MiB, the most by which CUDA's total fell "
                                          "short of nvidia-smi's on the GPUs seen (A100-40GB 424, H100 477, H200 "
                                          "613): CUDA's own figure not seen"),
    GPU("a100-40gb", 40536 * MIB, "CUDA total of A100-SXM4-40GB as printed in public logs: 40,536 MiB "
                                  "(nvidia-smi: 40,960)"),
    GPU("b200", 182631 * MIB, "CUDA total of B200 as torch prints it in public logs: 182,631-182,642 MiB "
                              "(not checked here)"),
)}
DEFAULT_GPU = "h100-80gb"


@dataclass(frozen=True)
class NcclMargin:
    bytes: int
    why: str


NCCL_TOPOLOGIES: dict[str, NcclMargin] = {
    "nvswitch": NcclMargin(2 * GIB, "one NVSwitch node, NVLS off: P2P buffers of up to 32 channels x 7 peers per "
                                    "communicator (~1 GiB at most) for the few communicators a step uses; +-1 GiB"),
    "nvswitch-ib": NcclMargin(3 * GIB, "NVSwitch nodes joined by InfiniBand, NVLS off: the P2P buffers plus the "
                                       "network proxy's and more peers per all-to-all; +-1.5 GiB"),
    "nvswitch-nvls": NcclMargin(6 * GIB, "NVLS left on: multicast buffers per communicator (public reports: "
                                         "1.6-6 GB); the upper figure"),
}


@dataclass(frozen=True)
class Margins:
    """Memory outside the tracker's view, stated rather than hidden (see the module docstring)."""

    # CUDA context, cuBLAS/cuDNN handles, outside torch's allocator: 0.92 GiB measured on the lent H200 (the H100's
    # chip, 132 SMs) once cuBLAS, cuDNN and the SDPA kernels had run (torch 2.11, CUDA 13.0); 1 GiB for others.
    cuda_context_bytes: int = 1 * GIB
    nccl_bytes: int = NCCL_TOPOLOGIES["nvswitch"].bytes
    fragmentation: float = 0.05  # caching-allocator slack over the live peak, with expandable_segments
    source: str = "stated defaults"
    # where each figure comes from, as the planner prints it (margins_for fills in the job's topology and calibration)
    cuda_context_why: str = ("stated: 1 GiB (0.92 GiB measured on the lent H200 with cuBLAS, cuDNN and SDPA loaded; "
                             "not measured on this GPU model)")
    nccl_why: str = f"stated for nvswitch: {NCCL_TOPOLOGIES['nvswitch'].why}"
    fragmentation_why: str = ("stated: 5% of the live peak (1.66% measured on the lent H200; not measured on this GPU "
                              "model)")

    def provenance(self) -> dict[str, str]:
        """Margin name -> where its figure comes from."""
        return {"cuda context": self.cuda_context_why, "nccl": self.nccl_why, "fragmentation": self.fragmentation_why}

    def named(self, device_bytes: int) -> dict[str, int]:
        """The margins as named breakdown entries for a live peak of `device_bytes`."""
        return {"margin: fragmentation": int(device_bytes * self.fragmentation),
                "margin: cuda context": self.cuda_context_bytes, "margin: nccl": self.nccl_bytes}


def topology_for(world_size: int, gpus_per_node: int = 8, nvls: bool = False) -> str:
    """The default NCCL topology of a job: one NVSwitch node, or several joined by InfiniBand, with NVLS off; with
    `nvls` (the job runs with NCCL_NVLS_ENABLE on: training/node_env.py `nvls_on`) the NVLS margin, on any number
    of nodes (its upper figure is the largest margin stated here)."""
    if nvls:
        return "nvswitch-nvls"
    return "nvswitch" if world_size <= gpus_per_node else "nvswitch-ib"


def resolve_gpu(spec: str) -> GPU:
    """A GPU by name (`h100-80gb`, `h200`, ...; `local` reads the present GPU) or by its usable GiB (`79.65`)."""
    key = spec.strip().lower()
    if key == "local":
        gpu = local_gpu()
        if gpu is None:
            raise ValueError("--gpu local needs a CUDA GPU on this machine; name one of "
                             f"{', '.join(GPUS)} or give its usable GiB")
        return gpu
    if key in GPUS:
        return GPUS[key]
    try:
        gib = float(key)
    except ValueError:
        raise ValueError(f"--gpu {spec!r} is unknown: name one of {', '.join(GPUS)}, 'local', or give the usable "
                         "GiB per GPU (e.g. 79.65)") from None
    if not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"--gpu {spec!r}: the usable memory per GPU must be a positive number of GiB")
    return GPU(f"{gib:g}GiB", int(gib * GIB), "given on the command line")


def local_gpu() -> GPU | None:
    """The present GPU's reported total (torch.cuda.mem_get_info), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    _, total = torch.cuda.mem_get_info()
    return GPU(torch.cuda.get_device_name().lower().replace(" ", "-"), total, "torch.cuda.mem_get_info on this GPU")


def margins_for(gpu: GPU, world_size: int, topology: str | None = None,
                calibration_file: Path = CALIBRATION_FILE) -> Margins:
    """Stated margins for `gpu` in a job of `world_size` GPUs, with a calibration of that GPU model when one was
    committed (its measured CUDA context and fragmentation replace the stated ones)."""
    topology = topology or topology_for(world_size)
    if topology not in NCCL_TOPOLOGIES:
        raise ValueError(f"NCCL topology {topology!r} is unknown; choose one of {', '.join(NCCL_TOPOLOGIES)}")
    margins = Margins(nccl_bytes=NCCL_TOPOLOGIES[topology].bytes, source=f"stated defaults, nccl: {topology}",
                      nccl_why=f"stated for {topology}: {NCCL_TOPOLOGIES[topology].why}")
    calibrated = read_calibration(gpu, calibration_file)
    if calibrated is not None:
        measured = f"measured on {calibrated['device']} by tools/gpu_check.sh ({calibration_file.name})"
        margins = replace(margins, cuda_context_bytes=calibrated["cuda_context_bytes"],
                          fragmentation=calibrated["fragmentation"],
                          source=f"calibrated on {calibrated['device']} ({calibration_file.name}), nccl: {topology}",
                          cuda_context_why=measured, fragmentation_why=measured)
    return margins


def read_calibration(gpu: GPU, path: Path = CALIBRATION_FILE) -> dict | None:
    """The committed calibration entry for this GPU model, if any. The file maps GPU names (as in GPUS) to
    {"device": reported name, "cuda_context_bytes": int, "fragmentation": float, ...} measured by gpu_check."""
    if not path.exists():
        return None
    entries = json.loads(path.read_text())
    entry = entries.get(gpu.name) if isinstance(entries, dict) else None
    if entry is None:
        return None
    missing = {"device", "cuda_context_bytes", "fragmentation"} - set(entry)
    if missing:
        raise ValueError(f"{path}: the entry for {gpu.name} lacks {sorted(missing)}; rerun tools/gpu_check.sh")
    return entry
