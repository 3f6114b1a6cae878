"""What the machine offers: the GPUs this process may use, read without touching CUDA.

CUDA_VISIBLE_DEVICES is the only truth about which GPUs a process may use. The inventory lists every
physical GPU (NVML through `pynvml`, else `nvidia-smi`), keeps those that CUDA_VISIBLE_DEVICES
names, in its order, and renumbers them 0..n-1: the indices a placement uses and the ones torch
calls `cuda:0`, `cuda:1`. Physical indices are NVML's (PCI bus order). CUDA numbers the same way
when CUDA_DEVICE_ORDER=PCI_BUS_ID, and on machines whose GPUs are all one model.

Neither NVML nor nvidia-smi creates a CUDA context. The last resort, torch, runs in a child
process so that this one never initialises CUDA (a context holds about half a GiB per GPU).
On a machine with no GPU every path fails quietly and the inventory is empty, with a note.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace

MIB = 1024**2
COMMAND_TIMEOUT_S = 20.0
TORCH_PROBE_TIMEOUT_S = 120.0
SMI_GPU_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.used,pci.bus_id",
                 "--format=csv,noheader,nounits"]
SMI_APPS_QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                  "--format=csv,noheader,nounits"]
SMI_TOPOLOGY = ["nvidia-smi", "topo", "-m"]
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass
class GpuProcess:
    """A process holding memory on a GPU (a CUDA context of its own)."""

    pid: int
    name: str
    used_bytes: int


@dataclass
class GpuInfo:
    """One GPU: `index` counts within CUDA_VISIBLE_DEVICES, `physical_index` is NVML's."""

    index: int
    physical_index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    processes: list[GpuProcess]
    pci_bus_id: str = ""

    @property
    def free_bytes(self) -> int:
        """Memory nobody holds yet (total - used)."""
        return max(self.total_bytes - self.used_bytes, 0)


@dataclass
class Inventory:
    """The visible GPUs and how they were found (`source`: nvml, nvidia-smi, torch or none)."""

    gpus: list[GpuInfo]
    cuda_visible_devices: str | None
    source: str
    torch_device_count: int
    interconnect: list[list[str]] | None = None
    note: str = ""


def parse_cuda_visible_devices(value: str | None, physical: list[tuple[int, str]],
                               problems: list[str] | None = None) -> list[int] | None:
    """Physical indices named by CUDA_VISIBLE_DEVICES, in its order; None when it is unset (all GPUs).

    `physical` lists (index, uuid) of every GPU. Entries are indices or UUIDs ("GPU-8a1f..." or a
    unique prefix of one). Like CUDA: "" (or only spaces) hides every GPU; the first invalid entry
    (negative, out of range, unknown, ambiguous, not a number) ends the list, keeping the entries
    before it; a GPU named twice hides every GPU. Each such finding is appended to `problems`.
    """
    if value is None:
        return None
    problems = problems if problems is not None else []
    if not value.strip():
        return []
    chosen: list[int] = []
    for position, raw_entry in enumerate(value.split(",")):
        entry = raw_entry.strip()
        physical_index, problem = _resolve_visible_entry(entry, physical)
        if problem:
            kept = f"GPUs {', '.join(map(str, chosen))} stay visible" if chosen else "no GPU is visible"
            problems.append(f"CUDA_VISIBLE_DEVICES={value}: entry {position + 1} ({entry!r}) {problem}; "
                            f"CUDA ignores it and every entry after it, so {kept}")
            break
        if physical_index in chosen:
            problems.append(f"CUDA_VISIBLE_DEVICES={value}: GPU {physical_index} is named twice; "
                            "CUDA then shows no GPU at all")
            return []
        chosen.append(physical_index)
    return chosen


def _resolve_visible_entry(entry: str, physical: list[tuple[int, str]]) -> tuple[int, str]:
    """(physical index, "") for a valid CUDA_VISIBLE_DEVICES entry, else (-1, what is wrong)."""
    if entry.upper().startswith("MIG-"):
        return -1, "is a MIG instance; this inventory lists whole GPUs only"
    if entry.upper().startswith("GPU-"):
        wanted = entry[4:].lower()
        matches = [index for index, uuid in physical if _bare_uuid(uuid).startswith(wanted)]
        if not wanted or not matches:
            return -1, "matches no GPU's UUID"
        if len(matches) > 1:
            return -1, f"is ambiguous: it starts the UUIDs of GPUs {', '.join(map(str, matches))}"
        return matches[0], ""
    number = re.match(r"[+-]?\d+", entry)  # CUDA reads entries like strtoul: "1abc" is 1
    if number is None:
        return -1, "is neither a GPU index nor a GPU-<uuid>"
    index = int(number.group())
    if index < 0:
        return -1, "is negative"
    indices = sorted(index for index, _ in physical)
    if index not in indices:
        valid = f"0-{len(indices) - 1}" if indices else "none: no GPU was found"
        return -1, f"is out of range (physical GPUs: {valid})"
    return index, ""


def _bare_uuid(uuid: str) -> str:
    return uuid[4:].lower() if uuid.upper().startswith("GPU-") else uuid.lower()


def restrict_to_visible(physical_gpus: list[GpuInfo], value: str | None,
                        problems: list[str]) -> list[GpuInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES keeps, in its order, with `index` renumbered from 0."""
    by_physical = {gpu.physical_index: gpu for gpu in physical_gpus}
    chosen = parse_cuda_visible_devices(value, [(gpu.physical_index, gpu.uuid) for gpu in physical_gpus],
                                        problems)
    order = sorted(by_physical) if chosen is None else chosen
    return [replace(by_physical[physical_index], index=visible_index)
            for visible_index, physical_index in enumerate(order)]


# --- nvidia-smi ------------------------------------------------------------------------------------


def _csv_rows(text: str) -> list[list[str]]:
    rows = csv.reader(io.StringIO(text), skipinitialspace=True)
    return [[cell.strip() for cell in row] for row in rows if row and any(cell.strip() for cell in row)]


def _mib(text: str) -> int:
    """Bytes from an nvidia-smi MiB figure; 0 for "[N/A]" (containers often hide per-process use)."""
    try:
        return int(float(text) * MIB)
    except ValueError:
        return 0


def parse_smi_gpus(gpu_csv: str, apps_csv: str = "") -> list[GpuInfo]:
    """Physical GPUs from the two nvidia-smi queries (SMI_GPU_QUERY, SMI_APPS_QUERY) in nounits CSV."""
    processes: dict[str, list[GpuProcess]] = {}
    for row in _csv_rows(apps_csv):
        if len(row) >= 4 and row[1].isdigit():
            processes.setdefault(row[0], []).append(GpuProcess(int(row[1]), row[2], _mib(row[3])))
    gpus = []
    for row in _csv_rows(gpu_csv):
        if len(row) < 6 or not row[0].isdigit():
            continue
        index, uuid, name, total, used, bus_id = row[:6]
        gpus.append(GpuInfo(index=int(index), physical_index=int(index), uuid=uuid, name=name,
                            total_bytes=_mib(total), used_bytes=_mib(used),
                            processes=processes.get(uuid, []), pci_bus_id=bus_id))
    return gpus


def parse_topology(text: str, physical_indices: list[int]) -> list[list[str]] | None:
    """The `nvidia-smi topo -m` cells between the given GPUs, in that order; None if any is missing.

    Cells: X (itself), NV<n> (n NVLinks), PIX/PXB (PCIe switches), PHB (host bridge), NODE (same
    NUMA node), SYS (across sockets).
    """
    lines = [ANSI_ESCAPE.sub("", line) for line in text.splitlines()]
    header_at = next((number for number, line in enumerate(lines) if line.split()[:1] == ["GPU0"]), None)
    if header_at is None:
        return None
    columns = [name for name in lines[header_at].split() if re.fullmatch(r"GPU\d+", name)]
    rows: dict[str, list[str]] = {}
    for line in lines[header_at + 1:]:
        cells = line.split()
        if cells and re.fullmatch(r"GPU\d+", cells[0]) and len(cells) > len(columns):
            rows[cells[0]] = cells[1:len(columns) + 1]
    names = [f"GPU{index}" for index in physical_indices]
    if any(name not in rows or name not in columns for name in names):
        return None
    return [[rows[row][columns.index(column)] for column in names] for row in names]


def _run_command(command: list[str]) -> str | None:
    """stdout of a command that succeeded, else None (missing program, error, timeout)."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout if result.returncode == 0 else None


def _smi_gpus() -> list[GpuInfo] | None:
    gpu_csv = _run_command(SMI_GPU_QUERY)
    if gpu_csv is None:
        return None
    return parse_smi_gpus(gpu_csv, _run_command(SMI_APPS_QUERY) or "")


# --- NVML ------------------------------------------------------------------------------------------


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def process_name(pid: int) -> str:
    """The command name of a pid (from /proc); "?" when it is not visible from here."""
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip() or "?"
    except OSError:
        return "?"


def _nvml_memory(pynvml, handle) -> tuple[int, int]:
    """(total, used) bytes, where used = total - free (it includes the driver's reservation)."""
    try:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    except (AttributeError, TypeError, pynvml.NVMLError):  # older bindings or drivers
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(memory.total), int(memory.total) - int(memory.free)


def _nvml_processes(pynvml, handle) -> list[GpuProcess]:
    try:
        running = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return []
    return [GpuProcess(pid=int(item.pid), name=process_name(int(item.pid)),
                       used_bytes=int(item.usedGpuMemory or 0)) for item in running]


def _nvml_gpus() -> list[GpuInfo] | None:
    """Physical GPUs through NVML; None when pynvml is missing or NVML does not start."""
    try:
        # on use: pynvml is optional (the inventory falls back to nvidia-smi)
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            total, used = _nvml_memory(pynvml, handle)
            gpus.append(GpuInfo(index=index, physical_index=index, uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                                name=_text(pynvml.nvmlDeviceGetName(handle)), total_bytes=total, used_bytes=used,
                                processes=_nvml_processes(pynvml, handle),
                                pci_bus_id=_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)))
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


# --- torch (last resort) ---------------------------------------------------------------------------

TORCH_PROBE = """
import json, torch
gpus = []
for index in range(torch.cuda.device_count()):
    properties = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    uuid = str(getattr(properties, "uuid", "") or "")
    gpus.append({"name": properties.name, "total": total, "used": total - free,
                 "uuid": uuid if not uuid or uuid.startswith("GPU-") else "GPU-" + uuid})
print(json.dumps(gpus))
"""


def torch_device_count() -> int:
    """torch.cuda.device_count(): asks the driver without creating a context; 0 when it fails."""
    try:
        # on use: this module reads the GPUs without torch (no CUDA context); torch is the last resort
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # a broken driver or CUDA install must not stop the doctor
        return 0


def _torch_gpus(value: str | None, env: dict[str, str], notes: list[str]) -> list[GpuInfo]:
    """Visible GPUs as torch sees them, probed in a child process (CUDA contexts die with it)."""
    try:
        result = subprocess.run([sys.executable, "-c", TORCH_PROBE], capture_output=True, text=True,
                                timeout=TORCH_PROBE_TIMEOUT_S, env=env)
        probed = json.loads(result.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        notes.append("the torch probe failed, so GPU names and memory are unknown")
        return []
    physical = _physical_indices_without_inventory(value, len(probed))
    notes.append("GPU processes are unknown (torch cannot list them); install nvidia-ml-py for them")
    return [GpuInfo(index=index, physical_index=physical[index], uuid=item["uuid"], name=item["name"],
                    total_bytes=int(item["total"]), used_bytes=int(item["used"]), processes=[])
            for index, item in enumerate(probed)]


def _physical_indices_without_inventory(value: str | None, count: int) -> list[int]:
    """Physical ids when only the visible count is known: from an index list, else -1 (unknown)."""
    if value is None:
        return list(range(count))
    entries = [entry.strip() for entry in value.split(",")][:count]
    if len(entries) == count and all(entry.isdigit() for entry in entries):
        return [int(entry) for entry in entries]
    return [-1] * count


# --- the inventory ---------------------------------------------------------------------------------


def _interconnect(gpus: list[GpuInfo], notes: list[str]) -> list[list[str]] | None:
    if not gpus:
        return None
    text = _run_command(SMI_TOPOLOGY)
    matrix = parse_topology(text, [gpu.physical_index for gpu in gpus]) if text else None
    if matrix is None:
        notes.append("interconnect unknown: `nvidia-smi topo -m` failed or did not list every visible GPU")
    return matrix


def _torch_count_note(torch_count: int, visible: int) -> str:
    if torch_count == visible:
        return ""
    try:
        # on use: this module reads the GPUs without torch (no CUDA context); torch is the last resort
        import torch

        cuda = torch.version.cuda
    except Exception:
        cuda = None
    reason = "torch is a CPU build" if cuda is None else "check the driver and CUDA_DEVICE_ORDER"
    counted = f"{visible} GPU is" if visible == 1 else f"{visible} GPUs are"
    return f"torch sees {torch_count} CUDA device(s) but {counted} visible ({reason})"


def inventory_from_system(env: dict[str, str] | None = None) -> Inventory:
    """The GPUs this process may use: NVML, else nvidia-smi, else torch (in a child), else none."""
    env = dict(os.environ if env is None else env)
    value = env.get("CUDA_VISIBLE_DEVICES")
    torch_count = torch_device_count()
    notes: list[str] = []
    if value is not None and not value.strip():
        notes.append("CUDA_VISIBLE_DEVICES is empty: it hides every GPU")
    source, physical = "nvml", _nvml_gpus()
    if physical is None:
        source, physical = "nvidia-smi", _smi_gpus()
    if physical is not None:
        gpus = restrict_to_visible(physical, value, notes)
        interconnect = _interconnect(gpus, notes)
        if not physical:
            notes.append(f"{source} lists no GPU")
        notes.append(_torch_count_note(torch_count, len(gpus)))
        if len({gpu.name for gpu in gpus}) > 1 and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            notes.append("mixed GPU models: set CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA numbers GPUs "
                         "as listed here (its default puts the fastest first)")
        return Inventory(gpus=gpus, cuda_visible_devices=value, source=source, torch_device_count=torch_count,
                         interconnect=interconnect, note="; ".join(note for note in notes if note))
    if torch_count > 0:
        gpus = _torch_gpus(value, env, notes)
        return Inventory(gpus=gpus, cuda_visible_devices=value, source="torch" if gpus else "none",
                         torch_device_count=torch_count, note="; ".join(notes))
    notes.insert(0, "no NVIDIA GPU found: NVML is unavailable (pynvml missing or no driver), nvidia-smi is "
                    "missing or failed, and torch sees no CUDA device")
    return Inventory(gpus=[], cuda_visible_devices=value, source="none", torch_device_count=torch_count,
                     note="; ".join(notes))
