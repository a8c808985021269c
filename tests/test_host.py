"""Host settings: core binding from a (fake or real) /sys, and the AOE dump's guard rails."""
from __future__ import annotations

import os

import pytest
import torch

import rewriter
from rewriter.devices import host


@pytest.mark.parametrize("text, cores", [
    ("0-3,8-11", [0, 1, 2, 3, 8, 9, 10, 11]),
    ("0", [0]),
    ("0-1\n", [0, 1]),
    (" 4-5 , 2 ", [2, 4, 5]),
    ("", []),                      # a memory-only NUMA node
    ("1,1-2", [1, 2]),
])
def test_parse_cpulist(text, cores):
    assert host.parse_cpulist(text) == cores


@pytest.mark.parametrize("text, message", [("3-1", "runs backwards"), ("0-3,x", "cannot read 'x'")])
def test_bad_cpulist_names_the_token(text, message):
    with pytest.raises(ValueError, match=message):
        host.parse_cpulist(text)


def test_format_cpulist_round_trips():
    assert host.format_cpulist([11, 0, 1, 2, 3, 8, 9, 10, 5]) == "0-3,5,8-11"
    assert host.parse_cpulist(host.format_cpulist([0, 2, 3, 4, 7])) == [0, 2, 3, 4, 7]


def _fake_sys(root, nodes: dict[int, str], pci: dict[str, str]):
    for n, cpulist in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    for address, node in pci.items():
        d = root / "bus" / "pci" / "devices" / address
        d.mkdir(parents=True)
        (d / "numa_node").write_text(node + "\n")
    return str(root)


@pytest.fixture
def eight_cpus(monkeypatch):
    """The process may run on CPUs 0-7 (the fake machine's), whatever this machine has."""
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(8)))


def test_binds_to_the_devices_pci_numa_node(tmp_path, monkeypatch, eight_cpus):
    root = _fake_sys(tmp_path, {0: "0-3", 1: "4-7", 2: ""}, {"0000:c1:00.0": "1"})
    monkeypatch.setattr(host, "device_pci_address", lambda device: "0000:c1:00.0")
    assert host.numa_nodes(root) == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}  # node2 has no CPUs
    binding = host.bind_cores("npu:0", sys_root=root, apply=False)
    assert (binding.node, binding.cores, binding.applied) == (1, [4, 5, 6, 7], False)
    assert "node of npu:0 at PCI 0000:c1:00.0" in binding.how
    assert "would bind to NUMA node 1, cores 4-7" in str(binding)


def test_unknown_device_node_falls_back_to_the_first_allowed_cpus_node(tmp_path, monkeypatch):
    root = _fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:c1:00.0": "-1"})
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {5, 6})
    monkeypatch.setattr(host, "device_pci_address", lambda device: "0000:c1:00.0")
    binding = host.bind_cores("npu:0", sys_root=root, apply=False)
    assert (binding.node, binding.cores) == (1, [5, 6])  # only the allowed CPUs of node 1
    assert "reports no NUMA node" in binding.how and "first allowed CPU 5" in binding.how


def test_explicit_node_and_topology_errors(tmp_path, eight_cpus):
    root = _fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, {})
    assert host.bind_cores("cpu", node=0, sys_root=root, apply=False).cores == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="NUMA node 5 does not exist"):
        host.bind_cores("cpu", node=5, sys_root=root, apply=False)
    with pytest.raises(RuntimeError, match="no NUMA topology"):
        host.bind_cores("cpu", sys_root=str(tmp_path / "empty"), apply=False)


def test_node_with_no_allowed_cpu_is_refused(tmp_path, monkeypatch):
    root = _fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, {})
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(RuntimeError, match="none of NUMA node 1's CPUs \\(4-7\\) is allowed"):
        host.bind_cores("cpu", node=1, sys_root=root, apply=False)


def test_npu_pci_address_from_npu_smi_with_visible_devices(monkeypatch):
    asked = []

    def npu_smi(physical_id):
        asked.append(physical_id)
        return "NPU ID : 6\n   PCIe Bus Info                  : 0000:C1:00.0\n   Chip Count : 1\n"

    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,6")
    assert host.npu_pci_address(1, run=npu_smi) == "0000:c1:00.0"
    assert asked == [6]  # logical 1 is physical 6
    assert host.npu_pci_address(2, run=npu_smi) is None  # not visible to this process


def test_real_binding_on_this_machine_and_undo():
    """Binds this test process for real (to its own NUMA node), then puts everything back."""
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        binding = rewriter.bind_cores("cpu")
        assert binding.applied and binding.cores
        assert set(binding.cores) <= before and os.sched_getaffinity(0) == set(binding.cores)
        assert torch.get_num_threads() <= len(binding.cores)
        binding.undo()
        assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


# --- AOE -----------------------------------------------------------------------------------

def test_aoe_command_is_the_guides():
    assert host.aoe_command("/data/aoe dump") == (
        "source /usr/local/Ascend/ascend-toolkit/set_env.sh && "
        "aoe --job_type=2 --model_path='/data/aoe dump'")


def test_aoe_needs_torch_npu(monkeypatch):
    monkeypatch.setattr(host, "import_torch_npu", lambda: None)
    with pytest.raises(ValueError, match="needs torch_npu"):
        host.check_aoe()


def test_aoe_refuses_several_processes_profiling_and_bound_cores(fake_torch_npu, monkeypatch):
    assert host.aoe_problems() == []
    monkeypatch.setenv("WORLD_SIZE", "2")
    with torch.profiler.profile():
        problems = host.aoe_problems(cores_bound=True)
    assert len(problems) == 3
    assert "one process only; this job has 2" in problems[0]
    assert "profiling is on" in problems[1] and "not to bind CPUs" in problems[2]


def test_aoe_dump_runs_one_step_with_dumping_on(fake_torch_npu, tmp_path, monkeypatch):
    monkeypatch.setattr(fake_torch_npu.npu, "aoe_dump_paths", [])
    steps = []
    dump = host.dump_aoe_step(lambda: steps.append(list(fake_torch_npu.npu.aoe_dump_paths)),
                              tmp_path / "aoe")
    # set_aoe came first, and the step ran exactly once after it
    assert steps == [[str(tmp_path / "aoe")]]
    assert os.path.isdir(dump.directory)
    assert dump.command.endswith(f"aoe --job_type=2 --model_path={tmp_path / 'aoe'}")
