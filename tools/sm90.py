"""One H100 / H200 SM's limits (sm_90) and how many programs of a kernel it holds at once, for the tools that
report what bounds a kernel's occupancy (``profile_step.py --resources``, ``attention_resources.py``)."""
from __future__ import annotations

SM90 = {"registers": 65536, "shared": 228 * 1024, "warps": 64, "blocks": 32}


def sm_limits(regs: int, shared: int, warps: int, sm: dict = SM90) -> dict[str, int]:
    """Programs of ``warps`` warps one SM holds by each resource: registers (``regs`` a thread), shared memory
    (``shared`` bytes a program), warps and resident blocks."""
    return {"registers": sm["registers"] // max(1, regs * 32 * warps), "shared": sm["shared"] // max(1, shared),
            "warps": sm["warps"] // warps, "blocks": sm["blocks"]}


def programs_per_sm(regs: int, shared: int, warps: int, sm: dict = SM90) -> tuple[int, str]:
    """How many programs of a kernel one SM holds at once, and which resource bounds it."""
    limits = sm_limits(regs, shared, warps, sm)
    bound = min(limits, key=limits.get)
    return limits[bound], bound
