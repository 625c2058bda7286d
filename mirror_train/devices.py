"""Devices are parameters: one function turns a user's device string into a checked `torch.device`.

Checking here, before any model is loaded or worker started, turns "cuda:1 on a one-GPU machine" into one clear
sentence instead of a CUDA error deep inside a forward. "auto" (every device setting's default) is CUDA where
there is a GPU, else the CPU.
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from mirror_train.errors import MirrorTrainError

DEVICE_HELP = "auto (CUDA when present, else the CPU), cpu, cuda, cuda:N or mps"


def cpuinfo(field: str) -> str | None:
    """The first processor's `field` in /proc/cpuinfo (`model name`, `flags`, `cpu family`), or None where there is
    none."""
    return _cpuinfo_fields().get(field)


# the widest unit first: what float32 / bf16 matmuls run on
VECTOR_UNITS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 + bf16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def cpu_model() -> str:
    """The CPU as every recorded figure names it: its name, family and model, and its widest vector unit, since a
    name alone ("AMD EPYC" under a hypervisor) leaves apart CPUs whose figures differ (Zen 3, AVX2 only; Zen 4 and
    Zen 5, AVX-512 and bf16 dot products)."""
    fields = _cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    about = []
    if "cpu family" in fields and "model" in fields:
        about.append(f"family {fields['cpu family']} model {fields['model']}")
    flags = set(fields.get("flags", "").split())
    about += [label for flag, label in VECTOR_UNITS if flag in flags][:1]
    return f"{name} ({', '.join(about)})" if about else name


@functools.cache
def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's /proc/cpuinfo fields by exact name (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """Parse and check a device string (`auto`, `cpu`, `cuda`, `cuda:1`, `mps`); `None` means `cpu`."""
    if spec is None:
        return torch.device("cpu")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise MirrorTrainError(f"not a device: {spec!r} (expected {DEVICE_HELP})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MirrorTrainError(f"device {spec!r} requested but CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise MirrorTrainError(f"device {spec!r} does not exist: this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise MirrorTrainError(f"device {spec!r} requested but MPS is not available on this machine")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise MirrorTrainError(f"unsupported device type {device.type!r} in {spec!r}")
    return device


def draft_device(spec: str, target: str | torch.device) -> torch.device:
    """Where the draft runs: `spec`, or for "auto" the next GPU after the target's when there is one (the paper's
    two devices), the target's own GPU on a one-GPU machine (a second process beside the target), else the CPU."""
    if spec != "auto":
        return resolve_device(spec)
    target = resolve_device(target)
    if target.type != "cuda":
        return torch.device("cpu")
    index = target.index if target.index is not None else torch.cuda.current_device()
    return torch.device("cuda", (index + 1) % torch.cuda.device_count())


def clock(device: str | torch.device) -> Callable[[], float]:
    """`time.perf_counter` that first waits for the device's queued work: a CUDA kernel returns at launch, so
    timings that size the engine's windows and branch budget would otherwise read the launch, not the work."""
    device = resolve_device(device)
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def fast_bf16(device: str | torch.device) -> bool:
    """Whether bf16 matmuls are fast here: CUDA with bf16 support, or a CPU with native bf16 dot products (AMX tiles,
    or AVX-512 BF16 as on AMD Zen 4 / Zen 5), which oneDNN uses. Measured at the draft's shapes, one thread: 3-4x a
    float32 matmul on the AMX Xeon, 2.5-4.7x at 8-32 rows on an AMD EPYC with avx512_bf16 (docs/drafter.md); CPUs
    without either (AVX2 only) emulate bf16 and are slower than float32."""
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)
    return False


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """ "float32" / "bfloat16", or "auto": bfloat16 where `fast_bf16(device)`, else float32."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device) else torch.float32
    if name not in ("float32", "bfloat16"):
        raise MirrorTrainError(f"dtype must be auto, float32 or bfloat16, got {name!r}")
    return getattr(torch, name)


@contextmanager
def pinned(cores: int | set[int] | None, threads: int):
    """Run the block on one core (the target's side of the two-device layout), or on a set of cores (a prompt's
    prefill spread over every core the engine holds), with `threads` intra-op threads; the affinity and thread count
    before it are restored after. Where the OS cannot pin a thread to a core (macOS), only the thread count is set."""
    if not hasattr(os, "sched_setaffinity"):
        cores = None
    before_threads = torch.get_num_threads()
    before_cores = os.sched_getaffinity(0) if cores is not None else None
    if cores is not None:
        os.sched_setaffinity(0, {cores} if isinstance(cores, int) else set(cores))
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before_threads)
        if cores is not None:
            os.sched_setaffinity(0, before_cores)


def usable_cores() -> set[int] | None:
    """The cores this process may run on (None where the OS does not say: macOS)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None


def cpu_quota() -> int | None:
    """The CPUs a container's quota (cgroup v2 `cpu.max`, else v1's `cfs_quota_us` / `cfs_period_us`) lets this
    process keep busy, rounded up; None where there is no quota. A container limited to 2 CPUs may still see every
    core of its host as usable: a thread for each would oversubscribe it."""
    for files in (
        ("/sys/fs/cgroup/cpu.max",),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            text = " ".join(open(f).read().strip() for f in files)
        except OSError:
            continue
        return parse_cpu_quota(text)
    return None


def parse_cpu_quota(text: str) -> int | None:
    """CPUs from "QUOTA PERIOD" (cgroup v2 `cpu.max`, or v1's two files joined), rounded up; None for no quota
    ("max", or -1 in v1) or what does not parse."""
    parts = text.split()
    try:
        quota, period = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None
