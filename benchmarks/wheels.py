"""Wheels of the GPU benchmark's peers for a machine without network.

    python -m benchmarks.wheels          # here, with network: fills benchmarks/wheels/

Downloads, at the versions installed here, `transformers`, `accelerate` and `lightning` and every
package they need (their requirements, followed; torch and numpy left out: a GPU machine has its
own builds), each with `pip download --no-deps --only-binary=:all:`. `benchmarks.gpu_bench` installs
from that folder, with `pip install --no-index --no-deps`, only the wheels of packages the machine
lacks, and only when one of the three cannot be found. The folder is git-ignored (binaries stay out
of the repository): copy it to the GPU machine with the working tree (~32 MB).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

WHEELS = Path(__file__).resolve().parent / "wheels"
ROOTS = ["transformers", "accelerate", "lightning"]
LEFT_OUT = {"torch", "numpy", "triton"}  # the machine's own (CUDA) builds


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """{distribution: installed version} of `roots` and everything they require here, followed
    (requirements under an extra or for another platform skipped)."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in found or name in LEFT_OUT:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def download(out: Path = WHEELS) -> list[str]:
    """Fetch the wheels into `out`; the pinned names."""
    pins = [f"{name}=={version}" for name, version in sorted(closure(ROOTS).items())]
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(out), *pins]
    subprocess.run(cmd, check=True)
    return pins


def _wheel_project(path: Path) -> str:
    return _canonical(parse_wheel_filename(path.name)[0])


def to_install(wheels: Path) -> list[Path]:
    """The wheels in `wheels` of projects not installed here that this Python and platform can
    install (one built for another would fail the whole install)."""
    installed = {_canonical(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
    supported = set(sys_tags())
    return [
        p
        for p in sorted(wheels.glob("*.whl"))
        if _wheel_project(p) not in installed and supported & set(parse_wheel_filename(p.name)[3])
    ]


def install_missing(modules: list[str], wheels: Path = WHEELS) -> list[str]:
    """When one of `modules` cannot be found and `wheels` has wheels: install, without network or
    dependency resolution, the wheels of every project not installed here. Returns their names."""
    if all(importlib.util.find_spec(m) is not None for m in modules) or not wheels.is_dir():
        return []
    chosen = to_install(wheels)
    if not chosen:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", *map(str, chosen)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        print(f"wheels: pip install failed:\n{run.stderr[-2000:]}", file=sys.stderr)
        return []
    importlib.invalidate_caches()
    return [p.name for p in chosen]


if __name__ == "__main__":
    for pin in download(Path(sys.argv[1]) if len(sys.argv) > 1 else WHEELS):
        print(pin)
