"""Why a process is terminated: the order behind each SIGTERM and SIGKILL of ``terminate.Terminator``,
what its log lines and Events say, and how it is written to (and read back from) the pending-SIGKILL
file so that a restarted enforcer says the same."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gpufence.enforcer.decide.rules import TerminateOrder


@dataclass(frozen=True)
class Why:
    """The order a signal is sent for (what the log lines and Events say)."""

    container: str | None
    device_uuid: str
    device_index: int
    used_bytes: int
    limit_bytes: int
    gpus_requested: int | None = None  # set: the container runs on more GPUs than it requested
    devices_used: tuple[int, ...] = ()
    evaded_pids: tuple[int, ...] = ()  # set: seen running while the throttle held them stopped
    evaded_phases: int = 0
    # set: SM use (0-1) that stayed over the compute share while the throttle held the processes
    ineffective_use: float | None = None
    compute_share: float | None = None
    held_seconds: float = 0.0

    @classmethod
    def of(cls, order: TerminateOrder) -> Why:
        return cls(order.container, order.device_uuid, order.device_index, order.used_bytes, order.limit_bytes,
                   order.gpus_requested, order.devices_used, order.evaded_pids, order.evaded_phases,
                   order.ineffective_use, order.compute_share, order.held_seconds)

    def record(self) -> dict[str, Any]:
        return {**asdict(self), "devices_used": list(self.devices_used), "evaded_pids": list(self.evaded_pids)}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], container: str | None) -> Why:
        """From ``record`` (a previous enforcer's); what is missing or malformed gets a neutral value
        (only the log lines and Events say it: the deadline is what matters)."""

        def get(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
            value = record.get(key)
            return value if isinstance(value, kind) and not isinstance(value, bool) else default

        def ints(key: str) -> tuple[int, ...]:
            value = record.get(key)
            return tuple(d for d in value if isinstance(d, int)) if isinstance(value, list) else ()

        requested = get("gpus_requested", int, None)
        return cls(get("container", str, container), get("device_uuid", str, ""), get("device_index", int, -1),
                   get("used_bytes", int, 0), get("limit_bytes", int, 0), requested, ints("devices_used"),
                   ints("evaded_pids"), get("evaded_phases", int, 0), get("ineffective_use", (int, float), None),
                   get("compute_share", (int, float), None), get("held_seconds", (int, float), 0.0))

    @property
    def resource(self) -> str:
        if self.evaded_pids or self.ineffective_use is not None:
            return "compute"
        return "gpus" if self.gpus_requested is not None else "memory"

    @property
    def log_reason(self) -> str:
        if self.evaded_pids:
            return "throttle_evaded"
        if self.ineffective_use is not None:
            return "throttle_ineffective"
        if self.gpus_requested is not None:
            return "gpus_over_request"
        return "memory_over_share" if self.container is not None else "pod_over_budget"

    @property
    def event_reason(self) -> str:
        if self.evaded_pids:
            return "GPUThrottleEvaded"
        if self.ineffective_use is not None:
            return "GPUThrottleIneffective"
        if self.gpus_requested is not None:
            return "GPUDevicesOverRequest"
        return "GPUMemoryOverShare" if self.container is not None else "GPUPodOverBudget"

    def evasion(self) -> str:
        return (f"pids {list(self.evaded_pids)} ran during their stopped phase in {self.evaded_phases} duty cycles "
                "within a minute (something else sends them SIGCONT)")

    def ineffective(self) -> str:
        return (f"SM use stayed at {self.ineffective_use or 0:.0%} over its compute share of "
                f"{self.compute_share or 0:.0%} for {self.held_seconds:.0f}s while the throttle held it stopped "
                "most of the time (its GPU work runs while it is stopped: SIGSTOP cannot hold it)")

    def unattributed(self, pid: int, process_used: int | None, grace: float) -> str:
        """The Event message for an unattributed victim."""
        if self.evaded_pids:
            what = f"unattributed {self.evasion()}"
        elif self.ineffective_use is not None:
            what = f"the pod's unattributed processes: {self.ineffective()}"
        elif self.gpus_requested is not None:
            what = (f"the pod runs on GPUs {list(self.devices_used)}, more than the {self.gpus_requested} it "
                    "requested, and has processes no container can be charged for")
        else:
            what = (f"the pod uses {self.used_bytes} bytes of GPU memory on {self.device_uuid}, over its budget of "
                    f"{self.limit_bytes}")
        return (f"{what}: SIGTERM to unattributed pid {pid} ({process_used} bytes), SIGKILL after {grace:g}s")
