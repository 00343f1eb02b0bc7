"""benchmarks/offline_wheels.py and install_parts.sh: wheels cut into parts come back whole and
install only once every part has arrived; the slimmed vLLM wheel loses exactly the unused files."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.offline_wheels import (
    NOT_LOADED,
    plan_parts,
    read_have,
    read_pins,
    slim_wheel,
    to_carry,
    write_parts,
    write_stand_in,
)

INSTALL = Path(__file__).resolve().parents[2] / "benchmarks" / "install_parts.sh"


def test_parts_never_exceed_the_limit_and_cover_every_byte():
    sizes = {"big.whl": 250, "mid.whl": 90, "a.whl": 10, "b.whl": 40}
    parts = plan_parts(sizes, limit=100)
    assert all(sum(end - start for _, start, end in part) <= 100 for part in parts)
    covered = {}
    for part in parts:
        for name, start, end in part:
            covered.setdefault(name, []).append((start, end))
    for name, size in sizes.items():
        ranges = sorted(covered[name])
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert len(parts) == 4  # 390 bytes: the 10- and 40-byte wheels fill gaps left by the cut one


def test_have_list_reads_names_from_lists_and_pip_freeze(tmp_path):
    have = tmp_path / "have.txt"
    have.write_text("# header\nTorch==2.11.0+cu130\ntyping_extensions>=4\nnvidia-ml-py @ file:///x\n\npyarrow\n")
    assert read_have(have) == {"torch", "typing-extensions", "nvidia-ml-py", "pyarrow"}
    # exact versions constrain the resolution, except the torch family the stand-ins replace
    have.write_text("torch==2.11.0+cu130\nTransformers==5.17.0  # the image's\nnumpy  # unpinned\n")
    assert read_pins(have) == ["transformers==5.17.0"]


def test_what_travels_leaves_out_the_target_and_kernels_never_loaded():
    resolved = [{"name": n, "version": "1", "url": ""} for n in
                ("vllm", "torch", "numpy", "flashinfer-python", "fastapi", "rlpipe")]
    assert [r["name"] for r in to_carry(resolved, have={"numpy"})] == ["vllm", "fastapi"]
    assert "flashinfer-python" in NOT_LOADED


def test_slim_wheel_drops_the_unused_files_and_their_record_lines(tmp_path):
    wheel = tmp_path / "vllm-0.1-py3-none-any.whl"
    record = "vllm/a.py,sha256=x,1\nvllm/big.so,sha256=y,2\nvllm/third/x.h,,\nvllm-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/a.py", "print(1)")
        z.writestr("vllm/big.so", b"\0" * 1000)
        z.writestr("vllm/third/x.h", "int x;")
        z.writestr("vllm-0.1.dist-info/RECORD", record)
    slim_wheel(wheel, ("vllm/big.so", "vllm/third/"))
    with zipfile.ZipFile(wheel) as z:
        assert sorted(z.namelist()) == ["vllm-0.1.dist-info/RECORD", "vllm/a.py"]
        assert z.read("vllm-0.1.dist-info/RECORD").decode() == \
            "vllm/a.py,sha256=x,1\nvllm-0.1.dist-info/RECORD,,\n"
        assert z.read("vllm/a.py") == b"print(1)"


def run_install(*args, store: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLPIPE_WHEEL_STORE": str(store),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not Path(sys.executable).with_name("python3").exists(), reason="no python3 beside this Python")
def test_parts_carried_one_at_a_time_install_once_all_arrived(tmp_path):
    wheels = tmp_path / "out" / "all"
    wheels.mkdir(parents=True)
    write_stand_in(wheels, "alpha", "1.0")
    # a wheel bigger than one part: padded with an incompressible file so it must be cut
    big = wheels / "beta-2.0-py3-none-any.whl"
    with zipfile.ZipFile(big, "w", zipfile.ZIP_STORED) as z:
        z.writestr("beta/__init__.py", "VALUE = 2\n")
        z.writestr("beta/blob.bin", os.urandom(3000))
        z.writestr("beta-2.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: beta\nVersion: 2.0\n")
        z.writestr("beta-2.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("beta-2.0.dist-info/RECORD", "")
    files = sorted(wheels.glob("*.whl"))
    folders = write_parts(files, tmp_path / "out", limit=1500)
    assert len(folders) >= 3 and any(p.name.endswith(".whl.01") for f in folders for p in f.iterdir())
    store, site = tmp_path / "store", tmp_path / "site"
    for i, folder in enumerate(folders):
        carried = tmp_path / f"call{i}"
        (carried / folder.name).mkdir(parents=True)
        for f in folder.iterdir():
            (carried / folder.name / f.name).write_bytes(f.read_bytes())
        assert run_install("collect", str(carried), store=store).returncode == 0
        result = run_install("install", str(site), store=store)
        if i < len(folders) - 1:
            assert result.returncode == 1 and "not yet whole" in result.stderr
            assert not site.exists()
    assert result.returncode == 0, result.stderr
    assert (store / big.name).read_bytes() == big.read_bytes()
    assert (site / "beta" / "__init__.py").read_text() == "VALUE = 2\n"
    assert (site / "alpha-1.0+target.dist-info").is_dir()
