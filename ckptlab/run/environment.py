"""Where a run was recorded: the machine and the builds whose kernels decide a float's last bits.

    env = capture()                       # the manifest's `environment`, on the recording machine
    diff = compare(manifest.get("environment"), capture(), device="cpu")   # on the replaying one

Bit-exact replay holds on the machine that recorded. Another CPU (its vector extensions decide
ATen's CPU capability, and so the order of a vectorized reduction), another torch, MKL or
oneDNN build, another GPU or driver, or kernels recorded without deterministic algorithms all
move the last bits. `compare` names each of those that differs, so that a replay that is not
bit-exact can say why (docs/replay.md, "Agreement with the record").
"""

from __future__ import annotations

import os
import platform
import re
from typing import Any

from ckptlab.io.files import read_text

NOT_RECORDED = "not recorded"  # environment_diff of a run recorded before ckptlab kept it

# `portable_cpu()`: the kernels every x86-64 CPU since 2013 runs alike: ATen's AVX2 kernels,
# MKL's conditional numerical reproducibility on its AVX2 code path, oneDNN up to AVX2.
PORTABLE = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2,STRICT", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# Vector extensions that change which kernels run (the rest of /proc/cpuinfo's flags do not).
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
VECTOR_PREFIXES = ("avx512", "amx")

# What `compare` checks, in order: (key path, what a person calls it).
FIELDS = (
    (("cpu", "model"), "CPU"),
    (("cpu", "capability"), "ATen CPU capability"),
    (("cpu", "vector_extensions"), "CPU vector extensions"),
    (("torch", "version"), "torch"),
    (("torch", "mkl"), "MKL"),
    (("torch", "onednn"), "oneDNN"),
    (("torch", "cuda"), "CUDA"),
    (("torch", "cudnn"), "cuDNN"),
    (("gpu", "name"), "GPU"),
    (("gpu", "capability"), "GPU compute capability"),
    (("gpu", "driver"), "GPU driver"),
    (("deterministic", "algorithms"), "deterministic algorithms"),
    (("deterministic", "cudnn"), "cuDNN deterministic"),
    (("deterministic", "mkl_cbwr"), "MKL_CBWR"),
    (("deterministic", "onednn_max_cpu_isa"), "ONEDNN_MAX_CPU_ISA"),
    (("deterministic", "cublas_workspace_config"), "CUBLAS_WORKSPACE_CONFIG"),
)
GPU_ONLY = {"GPU", "GPU compute capability", "GPU driver", "cuDNN", "CUDA", "cuDNN deterministic"}
GPU_ONLY |= {"CUBLAS_WORKSPACE_CONFIG"}


def capture() -> dict[str, Any]:
    """The execution environment of this process, now (torch already imported and dispatching)."""
    import torch

    return {
        "cpu": _cpu(torch),
        "torch": _build(torch),
        "gpu": _gpu(torch),
        "deterministic": {
            "algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn": bool(torch.backends.cudnn.deterministic),
            "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        },
    }


def portable_cpu() -> None:
    """Opt in to CPU recordings that replay bit-exactly on other x86-64 CPUs (AVX2 and up):
    pin ATen's CPU capability, MKL's code path and oneDNN's instruction set to AVX2 (PORTABLE).
    They are read once, when torch first runs a kernel, so call it before `import torch`
    (or set the variables when launching training); `ckptlab replay` sets the same before it
    loads torch. Costs some speed on a CPU with AVX-512 (docs/performance.md)."""
    import sys

    if "torch" in sys.modules:
        from ckptlab.errors import RecordError

        raise RecordError(
            "ckptlab.portable_cpu() must run before torch is imported (torch reads the kernel choice once)",
            hint=" ".join(f"{k}={v}" for k, v in PORTABLE.items()) + " python train.py",
        )
    os.environ.update(PORTABLE)


def pinned(env: Any) -> dict[str, str]:
    """The kernel choices a recording pinned through the environment (its ATEN_CPU_CAPABILITY,
    MKL_CBWR, ONEDNN_MAX_CPU_ISA), for a replay to pin alike before it loads torch."""
    out = {}
    for name, path in (
        ("ATEN_CPU_CAPABILITY", ("cpu", "capability_forced")),
        ("MKL_CBWR", ("deterministic", "mkl_cbwr")),
        ("ONEDNN_MAX_CPU_ISA", ("deterministic", "onednn_max_cpu_isa")),
    ):
        value = _get(env, path)
        if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_,]{1,32}", value):  # (a crafted run sets nothing else)
            out[name] = value
    return out


def _cpu(torch) -> dict[str, Any]:
    model, flags = platform.processor() or platform.machine(), []
    try:
        info = read_text("/proc/cpuinfo")
    except (OSError, ValueError):
        info = ""
    name = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    have = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
    if name:
        model = name.group(1).strip()
    if have:
        flags = sorted(f for f in have.group(1).split() if f in VECTOR_FLAGS or f.startswith(VECTOR_PREFIXES))
    capability = torch.backends.cpu.get_cpu_capability()
    return {
        "model": model,
        "machine": platform.machine(),
        "vector_extensions": flags,
        "capability": capability,
        "capability_forced": os.environ.get("ATEN_CPU_CAPABILITY"),  # set by the user, else None
    }


def _build(torch) -> dict[str, Any]:
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    onednn = re.search(r"MKL-DNN v([\w.]+)", config)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "mkl": mkl.group(1) if mkl else None,
        "onednn": onednn.group(1) if onednn else None,
    }


def _gpu(torch) -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
    return {
        "name": torch.cuda.get_device_name(),
        "capability": f"{major}.{minor}",
        "driver": driver,
        "count": torch.cuda.device_count(),
    }


def _part(env: dict, key: str) -> dict:
    part = env.get(key)
    return part if isinstance(part, dict) else {}


def _get(env: dict | None, path: tuple[str, str]) -> Any:
    part = env.get(path[0]) if isinstance(env, dict) else None
    return part.get(path[1]) if isinstance(part, dict) else None


def compare(recorded: Any, here: dict, *, gpu: bool) -> list[dict] | str:
    """What differs between the recording machine's environment and this one, as
    [{"what", "recorded", "here"}] in FIELDS' order ([]: nothing that moves bits differs), or
    NOT_RECORDED for a run recorded without it. `gpu`: the run was recorded or is replayed on a
    GPU (otherwise the GPU and CUDA fields are not compared)."""
    if not isinstance(recorded, dict):
        return NOT_RECORDED
    out = []
    for path, what in FIELDS:
        if what in GPU_ONLY and not gpu:
            continue
        a, b = _get(recorded, path), _get(here, path)
        if a != b:
            out.append({"what": what, "recorded": a, "here": b})
    return out


def describe(diff: list[dict] | str) -> str:
    """The differences in a few words: "ATen CPU capability AVX512 here DEFAULT, torch 2.3 here 2.4"."""
    if isinstance(diff, str):
        return f"the recording environment was {diff}"
    return ", ".join(f"{d['what']} {_show(d['recorded'])} (here {_show(d['here'])})" for d in diff)


def _show(v: Any) -> str:
    if isinstance(v, list):
        return " ".join(map(str, v)) or "none"
    return "none" if v is None else str(v)


def summary(env: Any) -> str | None:
    """One line for `ckptlab info`: "AMD EPYC, ATen CPU capability AVX512, torch 2.13.0 (MKL
    2024.2, oneDNN 3.12.0); GPU ..."; None for a run recorded without it."""
    if not isinstance(env, dict):
        return None
    cpu, build, gpu, det = (_part(env, k) for k in ("cpu", "torch", "gpu", "deterministic"))
    libs = ", ".join(f"{k} {build[key]}" for key, k in (("mkl", "MKL"), ("onednn", "oneDNN")) if build.get(key))
    cuda = ", ".join(f"{k} {build[key]}" for key, k in (("cuda", "CUDA"), ("cudnn", "cuDNN")) if build.get(key))
    line = (
        f"{cpu.get('model')}, ATen CPU capability {cpu.get('capability')}"
        + (" (forced)" if cpu.get("capability_forced") else "")
        + f"; torch {build.get('version')}"
        + (f" ({', '.join(x for x in (libs, cuda) if x)})" if libs or cuda else "")
    )
    if gpu:
        line += f"; GPU {gpu.get('name')} (compute {gpu.get('capability')}, driver {gpu.get('driver')})"
    line += "; deterministic algorithms " + ("on" if det.get("algorithms") else "off")
    pins = pinned(env)
    if pins:
        line += "; kernels pinned: " + " ".join(f"{k}={v}" for k, v in pins.items())
    return line
