"""Host-side settings for NPU (and GPU) training: core binding by NUMA node, and AOE tuning.

Both come from the Ascend tuning guide (调优手段5 绑核, 调优手段4 AOE); each is optional, and
what it did is returned so the caller can report it.

Core binding keeps the host threads that feed a device on the CPUs of that device's NUMA node:
ARM hosts have many weak cores, the kernel migrates busy threads between them, and each
migration costs cache and cross-node memory traffic (the guide's ``taskset -c 0-23``)::

    binding = rewriter.bind_cores("npu:0")   # or "cuda:1", "cpu", None (the auto device)
    print(binding)            # NUMA node 0, cores 0-23 (node of npu:0 at PCI 0000:c1:00.0)
    binding.undo()            # the affinity and torch thread count from before

AOE (Ascend Optimization Engine) operator tuning: dump the operators of ONE step with
``torch_npu.npu.set_aoe(dir)``, then tune them offline with ``aoe --job_type=2`` (reference
npu_ecosystem.md §5)::

    check_aoe(profiling=False, cores_bound=False)      # ValueError naming each problem
    dump = dump_aoe_step(step, "aoe_dump/")            # runs step() once with dumping on
    print(dump.command)   # source .../set_env.sh && aoe --job_type=2 --model_path=/abs/aoe_dump
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from rewriter.devices.backends import get_backend, import_torch_npu

log = logging.getLogger(__name__)

# --- cpulists ------------------------------------------------------------------------------


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8-11"`` -> ``[0, 1, 2, 3, 8, 9, 10, 11]`` (the kernel's cpulist format).

    An empty list (``""``, or a memory-only NUMA node's empty file) gives ``[]``.
    """
    cores: set[int] = set()
    for token in text.strip().split(","):
        token = token.strip()
        if not token:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", token)
        if m is None:
            raise ValueError(f"cpulist {text.strip()!r}: cannot read {token!r} (expected N or N-M)")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if last < first:
            raise ValueError(f"cpulist {text.strip()!r}: range {token!r} runs backwards")
        cores.update(range(first, last + 1))
    return sorted(cores)


def format_cpulist(cores: list[int] | tuple[int, ...] | set[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    ranges: list[str] = []
    ordered = sorted(set(cores))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        ranges.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(ranges)


# --- topology from /sys --------------------------------------------------------------------


def numa_nodes(sys_root: str = "/sys") -> dict[int, list[int]]:
    """CPUs of each NUMA node with CPUs, from ``<sys_root>/devices/system/node/node*/cpulist``."""
    nodes: dict[int, list[int]] = {}
    for path in glob.glob(os.path.join(sys_root, "devices", "system", "node", "node*", "cpulist")):
        m = re.fullmatch(r"node(\d+)", os.path.basename(os.path.dirname(path)))
        if m is None:
            continue
        with open(path) as f:
            cores = parse_cpulist(f.read())
        if cores:  # memory-only nodes (CXL, HBM) have no CPUs to bind to
            nodes[int(m.group(1))] = cores
    return dict(sorted(nodes.items()))


def pci_numa_node(pci_address: str, sys_root: str = "/sys") -> int | None:
    """The NUMA node of a PCI device, or None when the kernel does not know (it reports -1)."""
    path = os.path.join(sys_root, "bus", "pci", "devices", pci_address.lower(), "numa_node")
    try:
        with open(path) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _run_npu_smi(physical_id: int) -> str:
    """``npu-smi info -t board -i <id>``; its output names the card's PCIe bus address."""
    return subprocess.run(["npu-smi", "info", "-t", "board", "-i", str(physical_id)],
                          capture_output=True, text=True, timeout=20, check=True).stdout


def npu_pci_address(index: int, run: Callable[[int], str] = _run_npu_smi) -> str | None:
    """PCI address of logical NPU ``index``, from ``npu-smi`` (Ascend's driver tool).

    ``ASCEND_RT_VISIBLE_DEVICES`` renumbers devices for the process (reference §7), so logical
    ``index`` is the index-th id listed there. npu-smi reports ``PCIe Bus Info : 0000:C1:00.0``
    (as Ascend's manual binding guides use it); not run on Ascend hardware here.
    """
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    physical = index
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids) or not ids[index].isdigit():
            return None
        physical = int(ids[index])
    try:
        out = run(physical)
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("npu-smi failed for NPU %d: %s", physical, e)
        return None
    m = re.search(r"PCIe\s*Bus\s*Info\s*:\s*([0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])", out)
    return m.group(1).lower() if m else None


def device_pci_address(device: str | torch.device) -> str | None:
    """PCI address of an accelerator (``cuda:i`` from torch, ``npu:i`` from npu-smi), else None."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        try:
            return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        except AttributeError:  # older torch: no PCI fields
            return None
    if dev.type == "npu" and shutil.which("npu-smi"):
        return npu_pci_address(dev.index or 0)
    return None


# --- binding -------------------------------------------------------------------------------


@dataclass
class CoreBinding:
    """Where this process's threads were bound, and how that node was chosen."""

    node: int
    cores: list[int]
    device: str
    how: str  # why this node: the device's PCI node, an explicit node, or the fallback
    applied: bool
    threads: int  # torch intra-op threads after binding
    previous_cores: list[int] = field(default_factory=list)
    previous_threads: int = 0
    _tids: list[int] = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        verb = "bound to" if self.applied else "would bind to"
        return (f"{verb} NUMA node {self.node}, cores {format_cpulist(self.cores)} ({self.how}); "
                f"torch threads {self.threads}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("_tids")
        d["cpulist"] = format_cpulist(self.cores)
        return d

    def undo(self) -> None:
        """Put back the affinity and torch thread count from before :func:`bind_cores`."""
        if not self.applied:
            return
        _set_affinity(self._tids, set(self.previous_cores))
        torch.set_num_threads(self.previous_threads)
        self.applied = False


def bind_cores(device: str | torch.device | None = None, *, node: int | None = None,
               sys_root: str = "/sys", apply: bool = True) -> CoreBinding:
    """Bind this process's threads to the CPUs of ``device``'s NUMA node.

    Example::

        binding = rewriter.bind_cores("npu:0")
        print(binding)        # bound to NUMA node 0, cores 0-23 (node of npu:0 at PCI ...)

    Args:
        device: the accelerator the process feeds ("npu:0", "cuda:1", "cpu"); None: the auto
            device (npu > cuda > cpu). Its NUMA node comes from its PCI address in
            ``/sys/bus/pci/devices/<address>/numa_node``.
        node: bind to this NUMA node instead of the device's.
        sys_root: where sysfs is (tests point it at a fake tree).
        apply: False computes the binding without changing anything.

    When the device's node is unknown (a CPU, a VM that hides PCI topology, no npu-smi), the
    node of the first CPU this process may run on is used, else the first node. Only CPUs the
    process is allowed (cgroup, taskset) are used. torch's intra-op thread count is lowered to
    the number of bound cores when larger: more threads than cores would contend for them.

    Raises:
        ValueError: ``node`` is not a NUMA node with CPUs.
        RuntimeError: no NUMA topology under ``sys_root``, or none of the node's CPUs is allowed.
    """
    nodes = numa_nodes(sys_root)
    if not nodes:
        raise RuntimeError(f"no NUMA topology under {sys_root}/devices/system/node "
                           "(node*/cpulist missing); cannot bind cores")
    allowed = set(os.sched_getaffinity(0))
    if device is None:
        device = get_backend(None).name
    device_name = str(device)
    if node is not None:
        if node not in nodes:
            raise ValueError(f"NUMA node {node} does not exist or has no CPUs; nodes: {sorted(nodes)}")
        chosen, how = node, "node asked for"
    else:
        chosen, how = _device_node(device_name, nodes, allowed, sys_root)
    cores = sorted(set(nodes[chosen]) & allowed)
    if not cores:
        raise RuntimeError(f"none of NUMA node {chosen}'s CPUs ({format_cpulist(nodes[chosen])}) "
                           f"is allowed for this process ({format_cpulist(allowed)}; cgroup or taskset)")
    previous_threads = torch.get_num_threads()
    binding = CoreBinding(chosen, cores, device_name, how, False, previous_threads,
                          sorted(allowed), previous_threads)
    if apply:
        binding._tids = _set_affinity(None, set(cores), only_like=allowed)
        if previous_threads > len(cores):
            torch.set_num_threads(len(cores))
        binding.threads = torch.get_num_threads()
        binding.applied = True
        log.info("rewriter: %s", binding)
    return binding


def _device_node(device: str, nodes: dict[int, list[int]], allowed: set[int],
                 sys_root: str) -> tuple[int, str]:
    address = None
    try:
        address = device_pci_address(device)
    except (RuntimeError, ValueError) as e:  # an unknown device string, or no such device
        log.debug("no PCI address for %s: %s", device, e)
    if address is not None:
        found = pci_numa_node(address, sys_root)
        if found is not None and found in nodes:
            return found, f"node of {device} at PCI {address}"
    first = min(allowed) if allowed else None
    for n, cores in nodes.items():
        if first in cores:
            why = f"{device}'s NUMA node unknown" if address is None else \
                f"{device} at PCI {address} reports no NUMA node"
            return n, f"{why}; node of this process's first allowed CPU {first}"
    n = next(iter(nodes))
    return n, f"{device}'s NUMA node unknown; first node"


def _set_affinity(tids: list[int] | None, cores: set[int], only_like: set[int] | None = None
                  ) -> list[int]:
    """Set the affinity of the calling thread and of this process's other threads.

    ``os.sched_setaffinity(0, ...)`` binds only the calling thread; threads already started
    (torch's OpenMP pool, data loaders) keep their old mask, so each is set too. With
    ``only_like``, threads someone else already pinned elsewhere are left alone.
    Returns the thread ids changed.
    """
    os.sched_setaffinity(0, cores)
    changed = [0]
    candidates = tids if tids is not None else [int(t) for t in os.listdir("/proc/self/task")]
    for tid in candidates:
        if tid == 0:
            continue
        try:
            if only_like is not None and set(os.sched_getaffinity(tid)) != only_like:
                continue
            os.sched_setaffinity(tid, cores)
            changed.append(tid)
        except OSError:  # the thread exited meanwhile
            continue
    return changed


# --- AOE -----------------------------------------------------------------------------------

ASCEND_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


def aoe_command(dump_dir: str | os.PathLike) -> str:
    """The offline tuning command for a dump (job_type 2: operator tuning, reference §5)."""
    path = shlex.quote(os.path.abspath(os.fspath(dump_dir)))
    return f"source {ASCEND_SET_ENV} && aoe --job_type=2 --model_path={path}"


def world_size() -> int:
    """Processes in this job: torch.distributed's world, else the launcher's WORLD_SIZE."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def profiler_running() -> bool:
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def aoe_problems(*, profiling: bool = False, cores_bound: bool = False) -> list[str]:
    """Why an AOE dump cannot be taken now (empty: it can), per the tuning guide's warnings."""
    problems = []
    mod = import_torch_npu()
    if mod is None:
        problems.append("AOE needs torch_npu (Ascend NPU with CANN), which does not import here")
    elif not callable(getattr(getattr(mod, "npu", None), "set_aoe", None)):
        problems.append("this torch_npu has no torch_npu.npu.set_aoe")
    n = world_size()
    if n > 1:
        # Several processes dumping into one directory overwrite each other's graphs.
        problems.append(f"AOE dumps from one process only; this job has {n}")
    if profiling or profiler_running():
        problems.append("profiling is on; the profiler distorts the operators AOE tunes")
    if cores_bound:
        problems.append("cores are bound; AOE's constraints say not to bind CPUs while dumping")
    return problems


def check_aoe(*, profiling: bool = False, cores_bound: bool = False) -> None:
    """Raise ValueError naming every reason an AOE dump cannot be taken now."""
    problems = aoe_problems(profiling=profiling, cores_bound=cores_bound)
    if problems:
        raise ValueError("cannot dump for AOE: " + "; ".join(problems))


@dataclass(frozen=True)
class AoeDump:
    directory: str
    command: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def dump_aoe_step(step: Callable[[], None], dump_dir: str | os.PathLike,
                  synchronize: Callable[[], None] | None = None) -> AoeDump:
    """Run ``step`` ONCE with AOE dumping into ``dump_dir``; returns the tuning command.

    One step only: the dump is not de-duplicated, and more steps make tuning longer (tuning
    guide). Only static-shape operators are tuned, so run it on fixed input shapes. Dumping
    stays on for the rest of the process (torch_npu has no switch to turn it off): make this
    the last thing the process runs.
    """
    check_aoe()
    directory = os.path.abspath(os.fspath(dump_dir))
    mod = import_torch_npu()
    mod.npu.set_aoe(directory)  # creates the directory, turns on graph dumping (§5)
    step()
    if synchronize is not None:
        synchronize()
    return AoeDump(directory, aoe_command(directory))
