"""Where a run's rows were made and where an audit re-executes them (design: evidence
across CPUs): the same platform, one the audit can pin to the recorder's kernels, or
another one, whose rows are judged at the level that crosses platforms
(:mod:`kvreplay.audit.crossing`).

A contract records what chooses kernels: the machine, OS and libc, torch's CPU
capability and, from contract scheme 4 on, the CPU's vendor and kernel-choosing
features and the backend's own kernel report. A platform is the same only when all of
it was recorded and all of it matches. torch picks its vector kernels by a capability
the process may lower (``ATEN_CPU_CAPABILITY``): a run recorded under a lower one than
this CPU's is re-executed under that one, in a spawned worker (torch reads the setting
when it starts), and the audit says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# torch's x86 capabilities, lowest first: a CPU that runs one runs every one before it.
CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
CAPABILITY = "cpu_capability"
PIN = "ATEN_CPU_CAPABILITY"
FULL_SCHEME = 4  # the first contract scheme that records every kernel-choosing field


@dataclass(frozen=True)
class Platform:
    """The recorder's platform as this machine meets it: the kernel-choosing fields that
    differ (after a pin), whether the contract recorded them all, and the environment
    the re-execution runs under to pin torch's kernels to the recorder's."""

    differs: tuple[str, ...] = ()
    recorded_in_full: bool = True
    pin: dict[str, str] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        """Rows are compared bit for bit only on the recorder's platform."""
        return self.recorded_in_full and not self.differs

    def describe(self) -> str:
        """One sentence for the audit's report."""
        pinned = f"; torch's kernels pinned to {self.pin[PIN]}" if self.pin else ""
        if self.same:
            return f"platform: the recorder's{pinned}; re-executed rows compared bit for bit"
        if self.differs:
            said = f"differs from the recorder's in {', '.join(self.differs)}"
        else:
            said = "is not recorded in full by this run (contract scheme 3 or older)"
        return (
            f"platform: {said}{pinned}; re-executed rows are compared at the level that "
            "crosses platforms (tokens, parting only at near ties), bits only where equal"
        )


def meet(recorded: dict[str, Any], here: dict[str, Any], differing: list[str], scheme: int):
    """The platform of a run whose contract environment is ``recorded``, on this machine
    (environment ``here``), given the machine fields that differ."""
    pin = pin_for(recorded.get(CAPABILITY), here.get(CAPABILITY))
    differs = tuple(f for f in differing if not (pin and f == CAPABILITY))
    return Platform(differs, scheme >= FULL_SCHEME, pin)


def pin_for(recorded: Any, here: Any) -> dict[str, str]:
    """The environment that lowers torch's capability to the recorded one, when this CPU
    runs it and runs a higher one by default (none otherwise)."""
    if recorded == here or recorded not in CAPABILITIES or here not in CAPABILITIES:
        return {}
    if CAPABILITIES.index(recorded) > CAPABILITIES.index(here):
        return {}
    return {PIN: recorded.lower()}
