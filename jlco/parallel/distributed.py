"""Several processes, one JAX device set: `jax.distributed.initialize` from flags or the
environment, for a mesh that spans hosts.

Each process (one per host, or one per accelerator) runs the same command; process 0
also runs the coordinator service at --coordinator_address. After `initialize`,
`jax.devices()` lists every process's devices and a `jax.sharding.Mesh` over them runs
collectives across processes (on CPU through gloo over TCP).

Where the values come from, first found wins:

    value                 flag                     environment
    coordinator host:port --coordinator_address    JAX_COORDINATOR_ADDRESS (jax's own)
    process count         --num_processes          JAX_NUM_PROCESSES
    this process's index  --process_id             JAX_PROCESS_ID
    local devices         --local_device_ids       JAX_LOCAL_DEVICE_IDS (jax's own)

A process count of 1 (the default) is one process: nothing is initialised and jax is not
imported. `--num_processes=auto` hands the unset values to jax's cluster detection
(`jax._src.clusters`): Open MPI (OMPI_MCA_orte_hnp_uri), SLURM (SLURM_JOB_ID,
SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID), Cloud TPU VMs and GKE
TPU pods, Kubernetes jobs (needs the `kubernetes` package); JAX_COORDINATOR_PORT then
picks the coordinator's port.

`initialize` must run before anything creates a jax backend (jax.devices(), a
device_put, a jit call): jax refuses afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Mapping, Sequence

AUTO = "auto"
DEFAULT_TIMEOUT_S = 300
ENV = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
       "process_id": "JAX_PROCESS_ID", "local_device_ids": "JAX_LOCAL_DEVICE_IDS"}
DETECTED = "Open MPI, SLURM, Cloud TPU / GKE TPU, Kubernetes"
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the job (after `initialize`)."""
    process_index: int
    process_count: int
    local_devices: int
    global_devices: int

    @property
    def is_lead(self) -> bool:
        """Process 0: the one that prints results and binds ports."""
        return self.process_index == 0

    def describe(self) -> str:
        return (f"process {self.process_index} of {self.process_count}: "
                f"{self.local_devices} local of {self.global_devices} devices")


@dataclasses.dataclass(frozen=True)
class Request:
    """Validated arguments for `jax.distributed.initialize`; None fields are left to jax
    (its cluster detection when `auto`)."""
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    auto: bool = False


def _pick(name: str, value, environ: Mapping[str, str]) -> tuple[object, str]:
    """(value, label for errors): the argument, else its environment variable."""
    if value is not None and value != "":
        return value, f"--{name}"
    env = environ.get(ENV[name])
    if env is not None and env.strip():
        return env.strip(), ENV[name]
    return None, f"--{name}"


def _int(value, label: str, allowed: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{label}={value!r} is invalid: allowed {allowed}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label}={value!r} is invalid: allowed {allowed}") from None


def check_address(text: str, label: str = "--coordinator_address") -> str:
    """`text` if it is host:port (an IPv6 host in brackets) with a port in 1..65535."""
    m = _HOST_PORT.match(text)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{label}={text!r} is invalid: allowed host:port with a port in "
                         "1..65535, e.g. 10.0.0.1:1234 (process 0's address)")
    return text


def resolve(coordinator_address: str | None = None, num_processes: int | str | None = None,
            process_id: int | str | None = None,
            local_device_ids: Sequence[int] | str | None = None,
            environ: Mapping[str, str] | None = None) -> Request | None:
    """The checked request, or None for a single process. Each bad value is a one-line
    ValueError naming its flag (or environment variable) and what is allowed."""
    environ = os.environ if environ is None else environ
    n, n_label = _pick("num_processes", num_processes, environ)
    addr, addr_label = _pick("coordinator_address", coordinator_address, environ)
    pid, pid_label = _pick("process_id", process_id, environ)
    ids, ids_label = _pick("local_device_ids", local_device_ids, environ)
    auto = isinstance(n, str) and n.lower() == AUTO
    if auto:
        n = None
    elif n is None:
        n = 1
    else:
        n = _int(n, n_label, f"a positive integer or '{AUTO}' (jax's cluster detection)")
        if n < 1:
            raise ValueError(f"{n_label}={n} is invalid: allowed a positive integer or "
                             f"'{AUTO}' (jax's cluster detection)")
    if addr is not None:
        addr = check_address(str(addr), addr_label)
    if pid is not None:
        span = "0.." + ("N-1" if n is None else str(n - 1))
        pid = _int(pid, pid_label, f"an integer in {span}")
        if pid < 0 or (n is not None and pid >= n):
            raise ValueError(f"{pid_label}={pid} is invalid: allowed {span} "
                             f"({n_label}={AUTO if n is None else n})")
    if ids is not None:
        if isinstance(ids, str):
            parts = [t.strip() for t in ids.split(",")]
            ids = [_int(t, ids_label, "comma-separated device ids >= 0, e.g. 0,1") for t in parts]
        ids = tuple(int(i) for i in ids)
        if not ids or min(ids) < 0:
            raise ValueError(f"{ids_label}={ids!r} is invalid: allowed comma-separated "
                             "device ids >= 0, e.g. 0,1")
    if n == 1:
        if pid not in (None, 0):
            raise ValueError(f"{pid_label}={pid} is invalid with {n_label}=1: allowed 0")
        return None
    if not auto:
        if addr is None:
            raise ValueError(f"--coordinator_address is required with {n_label}={n}: allowed "
                             "host:port of process 0 (or set JAX_COORDINATOR_ADDRESS)")
        if pid is None:
            raise ValueError(f"--process_id is required with {n_label}={n}: allowed 0..{n - 1} "
                             "(or set JAX_PROCESS_ID)")
    return Request(addr, n, pid, ids, auto)


def initialize(coordinator_address: str | None = None, num_processes: int | str | None = None,
               process_id: int | str | None = None,
               local_device_ids: Sequence[int] | str | None = None,
               timeout_s: int = DEFAULT_TIMEOUT_S) -> ProcessInfo | None:
    """Join the job described by the arguments and the environment (module docstring);
    None, touching nothing, for a single process. Bad values are a one-line ValueError.
    A coordinator or peer not reached within `timeout_s` ends the process: jax's
    coordination service aborts it (SIGABRT, exit 134) with a DEADLINE_EXCEEDED line,
    as it does later when another process of the job dies (noticed within jax's 100 s
    heartbeat timeout, at once when the dead one is process 0)."""
    req = resolve(coordinator_address, num_processes, process_id, local_device_ids)
    if req is None:
        return None
    import jax
    native_stdout_to_stderr()
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        # cross-process collectives on CPU devices (jax's default today; "mpi" is the other)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=req.coordinator_address, num_processes=req.num_processes,
            process_id=req.process_id,
            local_device_ids=None if req.local_device_ids is None else list(req.local_device_ids),
            initialization_timeout=timeout_s)
    except ValueError as err:
        if req.auto:
            raise ValueError(f"--num_processes={AUTO}: jax's cluster detection ({DETECTED}) "
                             f"found no job here ({err}); give --coordinator_address, "
                             "--num_processes and --process_id") from None
        raise ValueError(f"jax.distributed.initialize: {err}") from None
    return process_info()


def native_stdout_to_stderr() -> None:
    """Point file descriptor 1 at stderr and give Python's `sys.stdout` a copy of the
    original: gloo prints its "[Gloo] Rank 0 is connected to 1 peer ranks" lines with
    C++ on fd 1, which would otherwise land in the middle of a `--json` result."""
    if getattr(sys.stdout, "_jlco_saved", False):
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    out = open(saved, "w", encoding=sys.stdout.encoding or "utf-8",
               errors=sys.stdout.errors or "strict", buffering=1)
    out._jlco_saved = True
    sys.stdout = out


def shutdown() -> None:
    """Leave the job once this process's work is done: a barrier with the other
    processes (jax's own exit hook does this, but entry points end with os._exit), so
    none is aborted for losing a peer that merely finished first. A no-op for one
    process. Not for error paths: a process that fails exits at once, and jax aborts
    the others."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        jax.distributed.shutdown()


def process_info() -> ProcessInfo:
    """This process's place in the job (one process when none was initialised)."""
    import jax
    return ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count(),
                       jax.device_count())


# ----------------------------------------------------------------------------- flags


def define_flags() -> None:
    """The multi-process flags of an entry point (defined only by programs, as their
    other flags are)."""
    from absl import flags
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0, where the "
                        "coordinator runs (default: $JAX_COORDINATOR_ADDRESS)")
    flags.DEFINE_string("num_processes", None, "processes in the job, one mesh over all "
                        f"their devices: an integer (default $JAX_NUM_PROCESSES, else 1) or "
                        f"'{AUTO}' (jax's cluster detection: {DETECTED})")
    flags.DEFINE_integer("process_id", None, "this process's index, 0..num_processes-1 "
                         "(default: $JAX_PROCESS_ID)")
    flags.DEFINE_string("local_device_ids", None, "comma-separated local devices this "
                        "process uses (default: $JAX_LOCAL_DEVICE_IDS, else all)")
    flags.DEFINE_integer("distributed_timeout_s", DEFAULT_TIMEOUT_S, "seconds to wait for "
                         "the coordinator and every process", lower_bound=1)


def multi_process_asked(num_processes: int | str | None,
                        environ: Mapping[str, str] | None = None) -> str | None:
    """'--num_processes=N' (or its environment variable) when more than one process or
    'auto' is asked for, else None (`resolve` judges other values); for entry points
    that run on one process only."""
    n, label = _pick("num_processes", num_processes, os.environ if environ is None else environ)
    text = str(n).strip().lower()
    if text == AUTO or (text.isdigit() and int(text) > 1):
        return f"{label}={n}"
    return None


def resolve_from_flags(flag_values) -> Request | None:
    """`resolve` with the values of `define_flags`'s flags (None: a single process)."""
    return resolve(flag_values.coordinator_address, flag_values.num_processes,
                   flag_values.process_id, flag_values.local_device_ids)


def initialize_from_flags(flag_values) -> ProcessInfo | None:
    """`initialize` with the values of `define_flags`'s flags."""
    return initialize(flag_values.coordinator_address, flag_values.num_processes,
                      flag_values.process_id, flag_values.local_device_ids,
                      flag_values.distributed_timeout_s)
