"""Which of the two SM90 NVFP4 GEMM families runs a configuration: the type of its tiling says it
(``MmaTiling``: ``sm90_moe_gemm``, mma.sync; ``WgmmaTiling``: ``sm90_moe_wgmma``, warpgroup MMA). The MoE layer and
the dense linear both build their kernels here, from what ``sm90_heuristics`` picks."""

from __future__ import annotations

from .sm90_config import GemmConfig, MmaTiling
from .sm90_moe_gemm import Sm90Nvfp4MmaGemm
from .sm90_moe_wgmma import Sm90Nvfp4WgmmaGemm

Gemm = Sm90Nvfp4MmaGemm | Sm90Nvfp4WgmmaGemm


def family(config: GemmConfig) -> type[Gemm]:
    """The GEMM family of a configuration: its tiling's type picks it."""
    return Sm90Nvfp4MmaGemm if isinstance(config.tiling, MmaTiling) else Sm90Nvfp4WgmmaGemm


def gemm_kernel(config: GemmConfig) -> Gemm:
    """The kernel object of a GEMM configuration (the kernel checks it: ``KernelArgumentError`` if it does not take
    it)."""
    return family(config)(config.problem, config.tiling)


def gemm_can_implement(config: GemmConfig) -> bool:
    """Whether the configuration's family takes it (nothing is built)."""
    return family(config).can_implement(config.problem, config.tiling)
