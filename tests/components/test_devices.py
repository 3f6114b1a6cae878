"""The GPU inventory: CUDA_VISIBLE_DEVICES parsing, nvidia-smi/NVML/torch paths, on constructed outputs.

The nvidia-smi texts below were captured on a 2 x H200 machine (the topology keeps its ANSI codes).
"""

from __future__ import annotations

import os
import sys
import types

from components import devices
from components.devices import GpuInfo, GpuProcess, parse_cuda_visible_devices

UUID_0 = "GPU-18dd05d6-eb0d-597c-abb3-a7da5d92c9ab"
UUID_1 = "GPU-fed77836-2be9-bb27-d2ad-b30e94fe8fc7"
SMI_GPUS = (f"0, {UUID_0}, NVIDIA H200, 143771, 0, 00000000:00:06.0\n"
            f"1, {UUID_1}, NVIDIA H200, 143771, 0, 00000000:00:07.0\n")
SMI_APPS_BUSY = f"{UUID_0}, 730, python3, 3590\n"
SMI_TOPOLOGY = ("\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
                "GPU0\t X \tNV18\t0-31\t0\t\tN/A\nGPU1\tNV18\t X \t0-31\t0\t\tN/A\n\nLegend:\n\n  X    = Self\n"
                "  NV#  = Connection traversing a bonded set of # NVLinks\n")
EIGHT = [(index, f"GPU-{index}000aaaa-0000") for index in range(8)]
MIB = 1024**2


# --- parse_cuda_visible_devices --------------------------------------------------------------------


def test_unset_means_every_gpu_and_empty_means_none():
    assert parse_cuda_visible_devices(None, EIGHT) is None
    assert parse_cuda_visible_devices("", EIGHT) == []
    assert parse_cuda_visible_devices("  ", EIGHT) == []


def test_integer_lists_keep_their_order():
    assert parse_cuda_visible_devices("4,5", EIGHT) == [4, 5]
    assert parse_cuda_visible_devices("5,4", EIGHT) == [5, 4]
    assert parse_cuda_visible_devices(" 2 , 7 ", EIGHT) == [2, 7]


def test_first_invalid_entry_ends_the_list_and_is_recorded():
    problems: list[str] = []
    assert parse_cuda_visible_devices("0,9,1", EIGHT, problems) == [0]
    assert problems == ["CUDA_VISIBLE_DEVICES=0,9,1: entry 2 ('9') is out of range (physical GPUs: 0-7); "
                        "CUDA ignores it and every entry after it, so GPUs 0 stay visible"]


def test_negative_entry_hides_the_rest():
    problems: list[str] = []
    assert parse_cuda_visible_devices("-1", EIGHT, problems) == []
    assert "entry 1 ('-1') is negative" in problems[0] and "no GPU is visible" in problems[0]
    assert parse_cuda_visible_devices("3,-1,4", EIGHT) == [3]


def test_not_a_number_ends_the_list_but_a_numeric_prefix_counts_like_strtoul():
    problems: list[str] = []
    assert parse_cuda_visible_devices("1,gpu2", EIGHT, problems) == [1]
    assert "is neither a GPU index nor a GPU-<uuid>" in problems[0]
    assert parse_cuda_visible_devices("1abc,2", EIGHT) == [1, 2]


def test_a_gpu_named_twice_hides_every_gpu():
    problems: list[str] = []
    assert parse_cuda_visible_devices("1,2,1", EIGHT, problems) == []
    assert problems == ["CUDA_VISIBLE_DEVICES=1,2,1: GPU 1 is named twice; CUDA then shows no GPU at all"]


def test_uuids_full_and_by_unique_prefix():
    physical = [(0, UUID_0), (1, UUID_1)]
    assert parse_cuda_visible_devices(UUID_1, physical) == [1]
    assert parse_cuda_visible_devices(f"GPU-fed7,{UUID_0}", physical) == [1, 0]
    assert parse_cuda_visible_devices("gpu-18DD05", physical) == [0]


def test_unknown_or_ambiguous_uuids_end_the_list():
    physical = [(0, "GPU-abc1"), (1, "GPU-abc2")]
    problems: list[str] = []
    assert parse_cuda_visible_devices("GPU-abc2,GPU-abc", physical, problems) == [1]
    assert "is ambiguous: it starts the UUIDs of GPUs 0, 1" in problems[0]
    problems.clear()
    assert parse_cuda_visible_devices("GPU-ffff", physical, problems) == []
    assert "matches no GPU's UUID" in problems[0]


def test_mig_instances_are_not_listed():
    problems: list[str] = []
    assert parse_cuda_visible_devices("MIG-1234", EIGHT, problems) == []
    assert "MIG instance" in problems[0]


def test_any_index_is_out_of_range_without_gpus():
    problems: list[str] = []
    assert parse_cuda_visible_devices("0", [], problems) == []
    assert "(physical GPUs: none: no GPU was found)" in problems[0]


def test_restrict_to_visible_renumbers_in_the_given_order():
    physical = devices.parse_smi_gpus(SMI_GPUS)
    visible = devices.restrict_to_visible(physical, "1,0", [])
    assert [(gpu.index, gpu.physical_index, gpu.uuid) for gpu in visible] == [(0, 1, UUID_1), (1, 0, UUID_0)]
    assert [gpu.index for gpu in devices.restrict_to_visible(physical, None, [])] == [0, 1]
    assert physical[0].index == 0 and physical[1].index == 1  # the input is not modified


# --- nvidia-smi parsing ----------------------------------------------------------------------------


def test_parse_smi_gpus_with_a_busy_gpu():
    gpus = devices.parse_smi_gpus(SMI_GPUS, SMI_APPS_BUSY)
    assert gpus[0] == GpuInfo(index=0, physical_index=0, uuid=UUID_0, name="NVIDIA H200",
                              total_bytes=143771 * MIB, used_bytes=0,
                              processes=[GpuProcess(pid=730, name="python3", used_bytes=3590 * MIB)],
                              pci_bus_id="00000000:00:06.0")
    assert gpus[1].processes == []
    assert gpus[0].free_bytes == 143771 * MIB


def test_parse_smi_tolerates_not_available_memory_and_junk_lines():
    apps = f"{UUID_1}, 42, /usr/bin/python3, [N/A]\nNo running processes found\n"
    gpus = devices.parse_smi_gpus("garbage\n" + SMI_GPUS, apps)
    assert len(gpus) == 2
    assert gpus[1].processes == [GpuProcess(pid=42, name="/usr/bin/python3", used_bytes=0)]


def test_parse_topology_of_the_visible_gpus():
    assert devices.parse_topology(SMI_TOPOLOGY, [0, 1]) == [["X", "NV18"], ["NV18", "X"]]
    assert devices.parse_topology(SMI_TOPOLOGY, [1]) == [["X"]]
    assert devices.parse_topology(SMI_TOPOLOGY, [2]) is None
    assert devices.parse_topology("NVIDIA-SMI has failed", [0]) is None


def test_parse_topology_with_nics_and_pcie_paths():
    text = ("\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tPIX\tSYS\tNODE\t0-15\t0\n"
            "GPU1\tPIX\t X \tSYS\tNODE\t0-15\t0\n"
            "GPU2\tSYS\tSYS\t X \tSYS\t16-31\t1\n"
            "NIC0\tNODE\tNODE\tSYS\t X \n")
    assert devices.parse_topology(text, [2, 0]) == [["X", "SYS"], ["SYS", "X"]]
    assert devices.parse_topology(text, [0, 1, 2]) == [["X", "PIX", "SYS"], ["PIX", "X", "SYS"], ["SYS", "SYS", "X"]]


# --- inventory_from_system -------------------------------------------------------------------------


def _fake_commands(monkeypatch, outputs: dict[str, str | None]) -> None:
    """nvidia-smi answers by its first query argument; NVML is absent."""
    monkeypatch.setattr(devices, "_nvml_gpus", lambda: None)
    monkeypatch.setattr(devices, "_run_command", lambda command: outputs.get(command[1]))
    monkeypatch.setattr(devices, "torch_device_count", lambda: 2)


def test_inventory_through_nvidia_smi_restricted_to_cuda_visible_devices(monkeypatch):
    _fake_commands(monkeypatch, {devices.SMI_GPU_QUERY[1]: SMI_GPUS, devices.SMI_APPS_QUERY[1]: SMI_APPS_BUSY,
                                 "topo": SMI_TOPOLOGY})
    inventory = devices.inventory_from_system({"CUDA_VISIBLE_DEVICES": "1"})
    assert inventory.source == "nvidia-smi"
    assert inventory.cuda_visible_devices == "1"
    assert [(gpu.index, gpu.physical_index, gpu.processes) for gpu in inventory.gpus] == [(0, 1, [])]
    assert inventory.interconnect == [["X"]]
    assert "torch sees 2 CUDA device(s) but 1 GPU is visible" in inventory.note


def test_inventory_without_topology_says_why(monkeypatch):
    _fake_commands(monkeypatch, {devices.SMI_GPU_QUERY[1]: SMI_GPUS})
    inventory = devices.inventory_from_system({})
    assert [gpu.index for gpu in inventory.gpus] == [0, 1]
    assert inventory.interconnect is None
    assert "interconnect unknown" in inventory.note


def test_inventory_records_a_bad_cuda_visible_devices(monkeypatch):
    _fake_commands(monkeypatch, {devices.SMI_GPU_QUERY[1]: SMI_GPUS, "topo": SMI_TOPOLOGY})
    inventory = devices.inventory_from_system({"CUDA_VISIBLE_DEVICES": "1,7"})
    assert [gpu.physical_index for gpu in inventory.gpus] == [1]
    assert "entry 2 ('7') is out of range (physical GPUs: 0-1)" in inventory.note


def test_inventory_on_a_machine_without_gpus(monkeypatch):
    _fake_commands(monkeypatch, {})
    monkeypatch.setattr(devices, "torch_device_count", lambda: 0)
    inventory = devices.inventory_from_system({"CUDA_VISIBLE_DEVICES": "0"})
    assert (inventory.gpus, inventory.source, inventory.torch_device_count) == ([], "none", 0)
    assert inventory.note.startswith("no NVIDIA GPU found")


def test_inventory_says_an_empty_cuda_visible_devices_hides_every_gpu(monkeypatch):
    _fake_commands(monkeypatch, {devices.SMI_GPU_QUERY[1]: SMI_GPUS})
    inventory = devices.inventory_from_system({"CUDA_VISIBLE_DEVICES": ""})
    assert inventory.gpus == [] and inventory.source == "nvidia-smi"
    assert inventory.note.startswith("CUDA_VISIBLE_DEVICES is empty: it hides every GPU")


def test_inventory_on_this_machine_never_raises():
    inventory = devices.inventory_from_system()
    assert inventory.source in ("nvml", "nvidia-smi", "torch", "none")
    assert inventory.cuda_visible_devices == os.environ.get("CUDA_VISIBLE_DEVICES")
    assert [gpu.index for gpu in inventory.gpus] == list(range(len(inventory.gpus)))


def test_torch_fallback_runs_in_a_child_process(monkeypatch):
    _fake_commands(monkeypatch, {})
    probe = ('print(\'[{"name": "NVIDIA H200", "total": 1000, "used": 100, "uuid": "GPU-1"},'
             ' {"name": "NVIDIA H200", "total": 1000, "used": 0, "uuid": "GPU-2"}]\')')
    monkeypatch.setattr(devices, "TORCH_PROBE", probe)
    inventory = devices.inventory_from_system({"CUDA_VISIBLE_DEVICES": "6,3", "PATH": os.environ.get("PATH", "")})
    assert inventory.source == "torch"
    assert [(gpu.index, gpu.physical_index, gpu.uuid, gpu.used_bytes) for gpu in inventory.gpus] == [
        (0, 6, "GPU-1", 100), (1, 3, "GPU-2", 0)]
    assert "processes are unknown" in inventory.note


def test_torch_fallback_with_uuids_leaves_physical_ids_unknown():
    assert devices._physical_indices_without_inventory("GPU-ab,GPU-cd", 2) == [-1, -1]
    assert devices._physical_indices_without_inventory(None, 2) == [0, 1]


# --- NVML, with a stand-in pynvml module -----------------------------------------------------------


class FakeNvmlError(Exception):
    pass


def _fake_pynvml(memory_v2: bool) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = FakeNvmlError
    module.nvmlMemory_v2 = 0x02000028
    calls = []
    module.calls = calls
    module.nvmlInit = lambda: calls.append("init")
    module.nvmlShutdown = lambda: calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = lambda index: index
    module.nvmlDeviceGetName = lambda handle: b"NVIDIA H200"  # old bindings return bytes
    module.nvmlDeviceGetUUID = lambda handle: [UUID_0, UUID_1][handle]
    module.nvmlDeviceGetPciInfo = lambda handle: types.SimpleNamespace(busId=f"00000000:00:0{6 + handle}.0")

    def memory(handle, version=None):
        if version is not None and not memory_v2:
            raise TypeError("unexpected keyword argument 'version'")
        return types.SimpleNamespace(total=100 * MIB, free=(90 if handle == 0 else 99) * MIB, used=0)

    module.nvmlDeviceGetMemoryInfo = memory
    own = types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=5 * MIB)
    hidden = types.SimpleNamespace(pid=2**22 + 7, usedGpuMemory=None)  # usedGpuMemory is None in containers
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: [own, hidden] if handle == 0 else []
    return module


def test_nvml_inventory(monkeypatch):
    for memory_v2 in (True, False):
        fake = _fake_pynvml(memory_v2)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        gpus = devices._nvml_gpus()
        assert [(gpu.physical_index, gpu.uuid, gpu.name, gpu.used_bytes) for gpu in gpus] == [
            (0, UUID_0, "NVIDIA H200", 10 * MIB), (1, UUID_1, "NVIDIA H200", 1 * MIB)]
        assert gpus[0].processes == [GpuProcess(os.getpid(), devices.process_name(os.getpid()), 5 * MIB),
                                     GpuProcess(2**22 + 7, "?", 0)]
        assert gpus[1].pci_bus_id == "00000000:00:07.0"
        assert fake.calls == ["init", "shutdown"]


def test_nvml_that_does_not_start_falls_through(monkeypatch):
    fake = _fake_pynvml(True)

    def refuse():
        raise FakeNvmlError("Driver Not Loaded")

    fake.nvmlInit = refuse
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert devices._nvml_gpus() is None


def test_process_name_from_proc():
    with open("/proc/self/comm") as handle:
        assert devices.process_name(os.getpid()) == handle.read().strip()
    assert devices.process_name(2**22 + 7) == "?"
