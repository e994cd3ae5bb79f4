"""The kernels ship with the package: a wheel installed in a fresh environment builds and runs them,
holds every subpackage of the checkout and generates with the embedded demo model."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_carries_every_package_and_the_kernels_and_runs_them(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("pagedinfer-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # torch and friends from the environment running the tests (a venv or not; its .pth files, such as
    # the checkout's editable install, are not run), pagedinfer from the wheel, whose site comes first
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    host = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    (Path(site) / "_host_packages.pth").write_text("".join(f"{p}\n" for p in host))
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", str(wheel)],
        check=True,
        capture_output=True,
    )
    probe = (
        "import pagedinfer, torch\n"
        "from pagedinfer.attention import cuda_kernels\n"
        "from pagedinfer.kernels import paged_decode\n"
        "from pagedinfer.kernels.sources import KERNELS_DIR\n"
        "print(pagedinfer.__file__)\n"
        "print(KERNELS_DIR)\n"
        "print(paged_decode.available())\n"
        "print(sorted(p.name for p in KERNELS_DIR.glob('*.cu')))\n"
        "print((KERNELS_DIR / 'cpu' / 'cuda_shim.h').is_file())\n"
        "from pathlib import Path\n"
        "top = Path(pagedinfer.__file__).parent\n"
        "print(sorted(str(p.parent.relative_to(top)) for p in top.rglob('__init__.py')))\n"
        "from pagedinfer import LLM, SamplingParams\n"
        "out = LLM().generate(['ROMEO:'], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)\n"
        "print(out[0].error, len(out[0].outputs[0].token_ids))\n"
    )
    cache = tmp_path / "kernel-cache"  # a cold cache: the installed source is compiled here
    # at -O1 (after the default -O3): the same sources and compiler, a third of the build time
    env = {**os.environ, "PAGEDINFER_CACHE": str(cache), "PAGEDINFER_CC_FLAGS": "-O1", "PYTHONPATH": ""}
    out = subprocess.run(
        [python, "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path, env=env
    ).stdout.splitlines()
    site = env_dir.resolve()
    assert Path(out[0]).resolve().is_relative_to(site), out[0]  # the wheel's copy, not the checkout
    assert Path(out[1]).resolve().is_relative_to(site), out[1]
    assert out[2] == "True" and list(cache.glob("cpu_paged_decode-*.so"))
    assert out[3] == "['cache_ops.cu', 'paged_attention.cu']" and out[4] == "True"
    top = ROOT / "pagedinfer"
    packages = sorted(str(p.parent.relative_to(top)) for p in top.rglob("__init__.py"))
    assert out[5] == str(packages)  # pyproject's package list misses none (pagedinfer.lora once did)
    assert out[6] == "None 3"  # the demo model loads from the wheel and generates


def test_a_missing_compiler_is_said_once_with_its_cost(tmp_path):
    env = {**os.environ, "CC": "no-such-compiler", "PAGEDINFER_CACHE": str(tmp_path)}
    probe = "from pagedinfer.kernels import paged_decode\nprint(paged_decode.available(), paged_decode.available())"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert run.stdout.strip() == "False False"
    assert run.stderr.count("CPU decode kernel is unavailable") == 1
    assert "no C compiler (no-such-compiler)" in run.stderr and "x slower" in run.stderr
