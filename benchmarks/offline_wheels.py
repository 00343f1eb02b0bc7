"""Wheels for an offline GPU machine that already has torch: vLLM, TRL and rlpipe's dependencies.

GPU machines without internet (air-gapped clusters, the lent benchmark machines) have CUDA torch,
transformers and friends but not vLLM, TRL, Prefect or MLflow. This resolves what they lack for
that machine's Python, drops what they have (`--have`, one name per line or `pip freeze` output)
and the CUDA extras vLLM never loads for a dense or MoE Qwen3 on Hopper, slims vLLM's wheel, and
packs the rest into numbered folders of at most `--part-mib` (a wheel too big for one is cut in
byte pieces, joined again by `install_parts.sh`):

    python -m benchmarks.offline_wheels --have benchmarks/gpu_image_packages.txt --out .whl
    # on the GPU machine, after copying every .whl/pNN folder over:
    bash benchmarks/install_parts.sh collect .whl      # as often as parts arrive
    bash benchmarks/install_parts.sh install /tmp/site && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIREMENTS = ["vllm==0.26.0", "trl==1.16.0", "datasets>=3", "peft>=0.13"]
# what the target's torch build brings: stand-ins keep the resolver from fetching CUDA wheels
TARGET_TORCH = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0"}
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in
                                                              (17, 24, 26, 27, 28, 31, 34, 35)]
# vLLM's hard requirements that a Qwen3 model on Hopper never imports (other attention, sampling
# and GEMM back ends, video decoding, a second CUDA toolkit); vLLM checks for each before use
NOT_LOADED = {
    "flashinfer-python", "flashinfer-cubin", "tilelang", "z3-solver",
    "tokenspeed-mla", "tokenspeed-triton", "humming-kernels", "quack-kernels", "cuda-tile",
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "nvidia-cudnn-frontend",
    "pynvvideocodec", "torchcodec", "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm",
    "nvidia-cuda-cccl", "nvidia-cuda-nvdisasm", "torch-c-dlpack-ext",
}
# Of vLLM's 290 MiB wheel: FlashAttention 2 (sm80, 123 MiB; Hopper runs FlashAttention 3 and vLLM
# imports each under try/except), the opt-in Rust frontend, Blackwell attention and DeepGEMM's
# builds for other Pythons
VLLM_UNUSED = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/fmha_sm100/",
               "vllm/third_party/deep_gemm/_C.cpython-313", "vllm/third_party/deep_gemm/_C.cpython-314")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _entries(path: Path) -> list[str]:
    """The `--have` file's lines without comments and blank lines."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def read_have(path: Path) -> set[str]:
    """Names from a list or `pip freeze` output; comments and blank lines skipped."""
    return {normalize(re.split(r"[=<>!~ @\[]", line, maxsplit=1)[0]) for line in _entries(path)}


def read_pins(path: Path) -> list[str]:
    """The `name==version` lines of the `--have` file: the target's versions, which the resolution
    must accept (the target's torch family aside: stand-ins take its place)."""
    pins = []
    for line in _entries(path):
        name, _, version = line.partition("==")
        if version and normalize(name) not in TARGET_TORCH:
            pins.append(f"{normalize(name)}=={version.strip()}")
    return pins


def write_stand_in(directory: Path, name: str, version: str) -> None:
    """An empty wheel that satisfies `name==version` without its CUDA dependencies."""
    dist = f"{name}-{version}+target.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}+target\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: rlpipe\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(directory / f"{name}-{version}+target-py3-none-any.whl", "w") as wheel:
        for filename, text in files.items():
            wheel.writestr(filename, text)


def target_args(python: str) -> list[str]:
    return (["--only-binary=:all:", "--python-version", python, "--implementation", "cp",
             "--abi", f"cp{python.replace('.', '')}"] + [a for p in PLATFORMS for a in ("--platform", p)])


def resolve(requirements: list[str], python: str, project: Path | None, pins: list[str] = ()) -> list[dict]:
    """pip's resolution for the target, as [{name, version}]; reads metadata, downloads no wheel.
    `pins` (the target's own versions) constrain it: a requirement they break fails here, not there."""
    with tempfile.TemporaryDirectory() as scratch:
        stand_ins = Path(scratch, "stand-ins")
        stand_ins.mkdir()
        for name, version in TARGET_TORCH.items():
            write_stand_in(stand_ins, name, version)
        report = Path(scratch, "report.json")
        constraints = Path(scratch, "target.txt")
        constraints.write_text("".join(f"{pin}\n" for pin in pins))
        stand_in_pins = [f"{n}=={v}+target" for n, v in TARGET_TORCH.items()]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "--find-links", str(stand_ins), "--target", str(Path(scratch, "t")),
               "--constraint", str(constraints),
               *target_args(python), *requirements, *stand_in_pins, *(["-e", str(project)] if project else [])]
        # the CPU-only torch cap of these machines would refuse the target's torch
        subprocess.run(cmd, check=True, env={**os.environ, "PIP_CONSTRAINT": ""})
        installs = json.loads(report.read_text())["install"]
    return [{"name": normalize(i["metadata"]["name"]), "version": i["metadata"]["version"]} for i in installs]


def to_carry(resolved: list[dict], have: set[str]) -> list[dict]:
    """What the target lacks and will load: not on it, not a stand-in, not rlpipe itself."""
    skip = have | NOT_LOADED | set(TARGET_TORCH) | {"rlpipe"}
    return [r for r in resolved if r["name"] not in skip]


def download(wanted: list[dict], into: Path, python: str) -> list[Path]:
    """The wheels pinned by the resolution, for the target (pip checks tags against it, not here)."""
    into.mkdir(parents=True, exist_ok=True)
    pins = [f"{w['name']}=={w['version']}" for w in wanted]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into),
                    *target_args(python), *pins], check=True, env={**os.environ, "PIP_CONSTRAINT": ""})
    return sorted(into.glob("*.whl"))


def slim_wheel(wheel: Path, unused: tuple[str, ...]) -> Path:
    """The same wheel without the files that start with one of `unused` (RECORD to match)."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if item.filename.startswith(unused):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "".join(line + "\n" for line in data.decode().splitlines()
                               if not line.split(",", 1)[0].startswith(unused)).encode()
            target.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    slim.replace(wheel)
    return wheel


def plan_parts(sizes: dict[str, int], limit: int) -> list[list[tuple[str, int, int]]]:
    """Folders of (file, start, end) byte ranges, each at most `limit` bytes; largest files first."""
    pieces = []
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
        pieces += [(name, start, min(start + limit, size)) for start in range(0, size, limit)]
    parts: list[list[tuple[str, int, int]]] = []
    for piece in pieces:  # first fit
        room = next((p for p in parts if sum(e - s for _, s, e in p) + piece[2] - piece[1] <= limit), None)
        if room is None:
            parts.append(room := [])
        room.append(piece)
    return parts


def write_parts(files: list[Path], out: Path, limit: int) -> list[Path]:
    """Copy `files` into out/p01.., cutting a file bigger than `limit` into name.NN pieces."""
    sizes = {f.name: f.stat().st_size for f in files}
    whole = {name for name, size in sizes.items() if size <= limit}
    folders = []
    for number, part in enumerate(plan_parts(sizes, limit), start=1):
        folder = out / f"p{number:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, start, end in part:
            with open(out / "all" / name, "rb") as source:
                source.seek(start)
                piece = name if name in whole else f"{name}.{start // limit:02d}"
                (folder / piece).write_bytes(source.read(end - start))
        folders.append(folder)
    manifest = "".join(f"{n} {s}\n" for n, s in sorted(sizes.items()))
    for folder in folders:  # whichever part arrives last, the install can check them all
        (folder / "manifest.txt").write_text(manifest)
    return folders


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--have", type=Path, required=True, help="packages the target already has")
    parser.add_argument("--out", type=Path, default=Path(".whl"))
    parser.add_argument("--python", default="3.12", help="the target's Python")
    parser.add_argument("--part-mib", type=int, default=58, help="leaves room for a checkout in 64 MiB")
    parser.add_argument("--requirement", action="append", default=[], help="more to carry")
    parser.add_argument("--no-project", action="store_true",
                        help="leave out rlpipe's own dependencies (Prefect, MLflow, DuckDB, Polars): "
                             "enough for tests/gpu and bench_gpu, not for `rlpipe run`")
    parser.add_argument("--keep-fa2", action="store_true",
                        help="keep vLLM's FlashAttention 2 kernel (+123 MiB): for GPUs older than Hopper")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty: remove it or name another folder")
    project = None if args.no_project else Path(__file__).resolve().parents[1]
    resolved = resolve(REQUIREMENTS + args.requirement, args.python, project, read_pins(args.have))
    wanted = to_carry(resolved, read_have(args.have))
    files = download(wanted, args.out / "all", args.python)
    for wheel in files:
        if wheel.name.startswith("vllm-"):
            slim_wheel(wheel, VLLM_UNUSED[1:] if args.keep_fa2 else VLLM_UNUSED)
    folders = write_parts(files, args.out, args.part_mib * 2**20)
    total = sum(f.stat().st_size for f in files)
    print(f"{len(files)} wheels, {total / 2**20:.0f} MiB, in {len(folders)} parts: "
          + " ".join(str(f) for f in folders))


if __name__ == "__main__":
    main()
