"""The device's two roofs: peak compute (GFLOP/s, per dtype) and peak memory bandwidth (GB/s).

Either measured once per machine by a short GEMM and copy micro-benchmark and cached as JSON
(with the CPU model from /proc/cpuinfo, the device name, torch version and thread count, so a
cache from another machine is never used), or documented figures for a named device, and the
result always says which::

    from rewriter.profile.peaks import device_peaks, documented_peaks

    peaks = device_peaks("cpu")                 # measured now, or read from the cache
    peaks.source                                # "measured 2026-12-01 on this machine: ..."
    documented_peaks("H100-SXM").gflops         # {'float32': 67000.0, 'bfloat16': 989000.0, ...}

The measured "peak" is what torch's own GEMM and copy reach here: an achievable ceiling, often
below the vendor's figure (CPU turbo and AVX frequencies, a shared machine). The cache is
``peaks.json`` in ``cache_dir``, else ``$REWRITER_CACHE_DIR``, else ``~/.cache/rewriter``.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from rewriter.devices.backends import Backend, get_backend
from rewriter.devices.cpu_identity import cpu_model

log = logging.getLogger(__name__)

__all__ = ["Peaks", "device_peaks", "measure_peaks", "documented_peaks", "DOCUMENTED", "cpu_model",
           "load_peaks", "resolve_peaks"]

FORMAT = 1


@dataclass(frozen=True)
class Peaks:
    """Peak compute per dtype (GFLOP/s) and memory bandwidth (GB/s) of one device, and where
    the figures come from (``source``: measured, documented, or given)."""

    device: str  # "cpu: Intel(R) Xeon(R) ...", "cuda: NVIDIA H100 ..."
    gflops: dict[str, float]  # dtype name ("float32", "bfloat16", "float16") -> GFLOP/s
    gb_per_s: float
    source: str
    measured: bool = False
    machine: dict[str, Any] = field(default_factory=dict)  # cpu model, torch, threads, ...

    def gflops_for(self, dtype: str | None) -> float:
        """The compute roof for a dtype (profiler or torch spelling), fp32's when not listed."""
        name = _dtype_name(dtype)
        return self.gflops.get(name) or self.gflops.get("float32") or max(self.gflops.values())

    def ridge(self, dtype: str | None = None) -> float:
        """FLOPs per byte where the two roofs meet: below it an operator is memory-bound."""
        return self.gflops_for(dtype) / self.gb_per_s

    def describe(self) -> str:
        roofs = ", ".join(f"{d} {v:,.0f} GFLOP/s" for d, v in self.gflops.items())
        return f"{self.device}: {roofs}; memory {self.gb_per_s:,.1f} GB/s ({self.source})"

    def to_dict(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "Peaks":
        try:
            return cls(str(d["device"]), {str(k): float(v) for k, v in d["gflops"].items()},
                       float(d["gb_per_s"]), str(d["source"]), bool(d.get("measured", False)),
                       dict(d.get("machine", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a peaks record (device, gflops, gb_per_s, source): {d!r}") from e


_DTYPE_NAMES = {"float": "float32", "c10::half": "float16", "c10::bfloat16": "bfloat16",
                "double": "float64", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
                "float32": "float32", "float64": "float64", "torch.float32": "float32",
                "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


def _dtype_name(dtype: str | None) -> str:
    return _DTYPE_NAMES.get((dtype or "float").strip().lower(), "float32")


# Vendor datasheet figures (dense, no sparsity), GFLOP/s and GB/s. float32 is plain FP32
# (CUDA cores), not TF32.
DOCUMENTED: dict[str, Peaks] = {
    "A100-SXM-80GB": Peaks("cuda: NVIDIA A100 SXM 80GB", {"float32": 19_500.0, "bfloat16": 312_000.0,
                           "float16": 312_000.0}, 2_039.0, "documented: NVIDIA A100 datasheet"),
    "H100-SXM": Peaks("cuda: NVIDIA H100 SXM", {"float32": 67_000.0, "bfloat16": 989_000.0,
                      "float16": 989_000.0}, 3_350.0, "documented: NVIDIA H100 datasheet"),
    "H200-SXM": Peaks("cuda: NVIDIA H200 SXM", {"float32": 67_000.0, "bfloat16": 989_000.0,
                      "float16": 989_000.0}, 4_800.0, "documented: NVIDIA H200 datasheet"),
}


def documented_peaks(name: str) -> Peaks:
    """Datasheet figures for a named device (see :data:`DOCUMENTED`)::

        documented_peaks("H100-SXM").gb_per_s   # 3350.0
    """
    key = next((k for k in DOCUMENTED if k.lower() == name.lower()), None)
    if key is None:
        raise ValueError(f"no documented peaks for {name!r}; known: {', '.join(DOCUMENTED)} "
                         "(or give a JSON file: {\"device\", \"gflops\": {dtype: GFLOP/s}, "
                         "\"gb_per_s\", \"source\"})")
    return DOCUMENTED[key]


def load_peaks(path: str | os.PathLike) -> Peaks:
    """Peaks from a JSON file of the user's (e.g. their device's datasheet)."""
    with open(path) as f:
        data = json.load(f)
    peaks = Peaks.from_dict(data)
    return peaks if peaks.source else Peaks(**{**asdict(peaks), "source": f"given in {path}"})


def _machine(backend: Backend) -> dict[str, Any]:
    m = backend.machine()
    info: dict[str, Any] = {"backend": backend.name, "cpu_model": m["cpu_model"],
                            "cpu_threads": int(m["cpu_threads"]), "torch": torch.__version__,
                            **backend.versions()}
    if m.get("device_name", "absent") != "absent":
        info["device_name"] = m["device_name"]
    return info


def _best_seconds(fn: Any, backend: Backend, repeats: int) -> float:
    fn()  # first call: allocation, library initialisation
    backend.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peaks(device: str | torch.device | Backend | None = None, *, gemm_size: int | None = None,
                  copy_mib: int | None = None, repeats: int = 10) -> Peaks:
    """Measure the two roofs: the best of ``repeats`` square GEMMs (per dtype the device runs
    fast: fp32 on CPU; fp32, bf16, fp16 on CUDA/NPU) and of a copy of ``copy_mib`` MiB (2 bytes
    moved per byte copied). About a second on a CPU::

        measure_peaks("cpu").describe()
    """
    backend = get_backend(device)
    dev = torch.device(backend.device_type if backend.name != "cpu" else "cpu")
    on_cpu = backend.name == "cpu"
    n = gemm_size or (1024 if on_cpu else 8192)
    mib = copy_mib or (64 if on_cpu else 1024)
    dtypes = [torch.float32] + ([] if on_cpu else [torch.bfloat16, torch.float16])
    gflops = {}
    for dt in dtypes:
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        seconds = _best_seconds(lambda: torch.mm(a, b), backend, repeats)
        gflops[str(dt).rsplit(".", 1)[-1]] = 2.0 * n ** 3 / seconds / 1e9
        del a, b
    src = torch.empty(mib * 2**20 // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), backend, repeats)
    gb_per_s = 2.0 * src.numel() * 4 / seconds / 1e9
    machine = _machine(backend)
    name = machine.get("device_name") or machine["cpu_model"]
    source = (f"measured {time.strftime('%Y-%m-%d')} on this machine: best of {repeats} {n}x{n} "
              f"GEMMs and {mib} MiB copies, {machine['cpu_threads']} CPU threads")
    return Peaks(f"{backend.name}: {name}", gflops, gb_per_s, source, True, machine)


def _cache_file(cache_dir: str | os.PathLike | None) -> str:
    root = cache_dir or os.environ.get("REWRITER_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "rewriter")
    return os.path.join(root, "peaks.json")


def _same_machine(a: dict, b: dict) -> bool:
    keys = ("backend", "cpu_model", "cpu_threads", "torch", "torch_npu", "device_name")
    return all(a.get(k) == b.get(k) for k in keys)


def device_peaks(device: str | torch.device | Backend | None = None, *,
                 cache_dir: str | os.PathLike | None = None, measure: bool = True,
                 refresh: bool = False) -> Peaks | None:
    """The peaks of this machine's device: from the cache when it holds a measurement of the
    same machine (CPU model, threads, device, torch), else measured now and cached. With
    ``measure=False``, only the cache (None when it has none)::

        peaks = device_peaks("cpu", cache_dir="~/.cache/rewriter")
    """
    backend = get_backend(device)
    path = _cache_file(os.path.expanduser(str(cache_dir)) if cache_dir else None)
    machine = _machine(backend)
    entries: list[dict] = []
    try:
        with open(path) as f:
            entries = [e for e in json.load(f).get("entries", []) if isinstance(e, dict)]
    except FileNotFoundError:
        pass
    except (OSError, ValueError, AttributeError) as e:  # a corrupt cache is measured again
        log.warning("peaks cache %s unreadable (%s): measuring again", path, e)
    for e in entries if not refresh else ():
        if _same_machine(e.get("machine", {}), machine):
            try:
                cached = Peaks.from_dict(e)
                return replace(cached, source=f"{cached.source}; read from the cache {path}")
            except ValueError as err:
                log.warning("peaks cache %s: %s", path, err)
    if not measure:
        return None
    log.info("measuring %s peaks (GEMM and copy micro-benchmark) for the roofline", backend.name)
    peaks = measure_peaks(backend)
    entries = [e for e in entries if not _same_machine(e.get("machine", {}), machine)] + [peaks.to_dict()]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"format": FORMAT, "entries": entries}, f, indent=2)
        os.replace(tmp, path)
        peaks = Peaks(peaks.device, peaks.gflops, peaks.gb_per_s, f"{peaks.source}; cached in {path}",
                      True, peaks.machine)
    except OSError as e:
        log.warning("peaks not cached (%s): %s", path, e)
    return peaks


def resolve_peaks(spec: "Peaks | str", device: str | torch.device | Backend | None = None, *,
                  cache_dir: str | os.PathLike | None = None) -> Peaks | None:
    """Peaks from what a user names: a :class:`Peaks`; ``"auto"`` (this machine's, measured once
    and cached); ``"cached"`` (only a cached measurement, else None); ``"measure"`` (measured
    again, replacing the cached figures); a documented device name
    (:data:`DOCUMENTED`); or a JSON file's path::

        resolve_peaks("auto", "cpu"); resolve_peaks("H100-SXM"); resolve_peaks("my_npu.json")
    """
    if isinstance(spec, Peaks):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"peaks must be a Peaks, 'auto', 'cached', a device name or a JSON path, got {spec!r}")
    if spec == "auto":
        return device_peaks(device, cache_dir=cache_dir)
    if spec == "cached":
        return device_peaks(device, cache_dir=cache_dir, measure=False)
    if spec == "measure":
        return device_peaks(device, cache_dir=cache_dir, refresh=True)
    if spec.endswith(".json") or os.path.exists(spec):
        if not os.path.exists(spec):
            raise ValueError(f"peaks file {spec!r} does not exist")
        return load_peaks(spec)
    return documented_peaks(spec)
