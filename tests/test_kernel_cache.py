"""The compiled-kernel cache is the user's alone (pagedinfer/attention/kernel_cache.py): per user by
default, created private, and a folder or library another user could have written is refused
before anything is loaded from it."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from cli_helpers import invoke, one_line_error, tiny_model, write_jsonl

from pagedinfer import envs
from pagedinfer.kernels import build, kernel_cache, paged_decode


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _open_to_all(path: Path, mode: int = 0o777) -> Path:
    path.mkdir(exist_ok=True)
    path.chmod(mode)
    return path


def test_the_default_is_per_user_under_xdg_cache_home_and_created_private(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDINFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert envs.kernel_cache() == tmp_path / "xdg" / "pagedinfer" / "kernels"
    assert kernel_cache.folder() == tmp_path / "xdg" / "pagedinfer" / "kernels"
    for made in ("xdg", "xdg/pagedinfer", "xdg/pagedinfer/kernels"):  # every folder it had to create
        assert _mode(tmp_path / made) == 0o700, made
    assert kernel_cache.folder("cuda_on_cpu") == tmp_path / "xdg" / "pagedinfer" / "kernels" / "cuda_on_cpu"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: ignored, as XDG says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert envs.kernel_cache() == tmp_path / "home" / ".cache" / "pagedinfer" / "kernels"
    monkeypatch.setenv("PAGEDINFER_CACHE", str(tmp_path / "mine"))
    assert envs.kernel_cache() == tmp_path / "mine"


def test_a_cache_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = _open_to_all(tmp_path / "shared")
    monkeypatch.setenv("PAGEDINFER_CACHE", str(shared))
    with pytest.raises(kernel_cache.KernelCacheError) as e:
        kernel_cache.folder()
    assert str(e.value) == (
        f"the kernel cache {shared} is writable by other users (mode 0777): a library placed there "
        f"would run as you; chmod go-w {shared}, or set PAGEDINFER_CACHE to a folder of your own"
    )
    shared.chmod(0o755)
    assert kernel_cache.folder() == shared


def test_a_cache_inside_a_folder_others_can_write_is_refused_unless_sticky(tmp_path, monkeypatch):
    parent = _open_to_all(tmp_path / "open")
    monkeypatch.setenv("PAGEDINFER_CACHE", str(parent / "kernels"))
    with pytest.raises(kernel_cache.KernelCacheError) as e:
        kernel_cache.folder()
    assert str(e.value) == (
        f"the kernel cache {parent / 'kernels'} is inside {parent}, which other users can write (uid "
        f"{os.geteuid()}, mode 0777): they could replace the cache; set PAGEDINFER_CACHE to a folder of your own"
    )
    parent.chmod(0o1777)  # as /tmp: others cannot rename what is not theirs
    assert kernel_cache.folder() == parent / "kernels" and _mode(parent / "kernels") == 0o700


def test_a_cache_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDINFER_CACHE", str(tmp_path / "k"))
    kernel_cache.folder()
    owner = (tmp_path / "k").stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)
    with pytest.raises(
        kernel_cache.KernelCacheError,
        match=rf"^the kernel cache {tmp_path / 'k'} belongs to another user \(uid {owner}\)",
    ):
        kernel_cache.folder()


@pytest.fixture
def planted(tmp_path, monkeypatch) -> Path:
    """A file where the decode kernel's library is looked for, in a private cache."""
    compiler = shutil.which(envs.c_compiler())
    if compiler is None:
        pytest.skip("no C compiler: no library is ever loaded from the cache")
    monkeypatch.setenv("PAGEDINFER_CACHE", str(tmp_path / "k"))
    lib = build._targets(paged_decode.SOURCE, compiler)[0][1]
    lib.write_bytes(b"not a library")
    return lib


def test_a_library_others_can_write_is_refused_before_it_is_loaded(planted):
    planted.chmod(0o666)
    message = (
        f"the compiled kernel {planted} is writable by other users (mode 0666): a library placed there "
        "would run as you; delete it (it is built again), or set PAGEDINFER_CACHE to a folder of your own"
    )
    for load in (
        lambda: build.compile_library(paged_decode.SOURCE),
        lambda: build.prebuild([paged_decode.SOURCE]),
    ):
        with pytest.raises(kernel_cache.KernelCacheError) as e:
            load()
        assert str(e.value) == message


def test_a_library_of_another_user_is_refused(planted, monkeypatch):
    owner = planted.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 4242)
    with pytest.raises(
        kernel_cache.KernelCacheError, match=rf"^the compiled kernel {planted} belongs to another user"
    ):
        kernel_cache.library(planted)


def test_a_built_library_is_made_private_and_renamed_into_place(tmp_path):
    tmp, lib = tmp_path / "x.123.tmp", tmp_path / "x.so"
    tmp.write_bytes(b"\x7fELF")
    tmp.chmod(0o775)  # a umask of 002 (user private groups) leaves the compiler's output group-writable
    assert kernel_cache.seal(tmp, lib) == lib
    assert not tmp.exists() and _mode(lib) == 0o700 and kernel_cache.library(lib) == lib


def test_an_unsafe_cache_is_one_line_before_the_model_runs(tmp_path, monkeypatch):
    if shutil.which(envs.c_compiler()) is None:
        pytest.skip("no C compiler: the kernels are not used, nor their cache")
    shared = _open_to_all(tmp_path / "shared")
    monkeypatch.setenv("PAGEDINFER_CACHE", str(shared))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt_token_ids": [1, 2], "max_tokens": 2}])
    result = invoke("run", prompts, "-q", "--device", "cpu", "--model", str(tiny_model()))
    one_line_error(
        result,
        f"the kernel cache {shared} is writable by other users (mode 0777): a library placed there would "
        f"run as you; chmod go-w {shared}, or set PAGEDINFER_CACHE to a folder of your own",
    )
    assert list(shared.iterdir()) == []  # nothing compiled into it


def test_the_cuda_kernels_built_for_the_cpu_use_the_same_checks(tmp_path, monkeypatch):
    from pagedinfer.attention import cuda_on_cpu

    monkeypatch.setenv("PAGEDINFER_CACHE", str(_open_to_all(tmp_path / "shared")))
    with pytest.raises(kernel_cache.KernelCacheError, match="is writable by other users"):
        cuda_on_cpu.RawModule('extern "C" __global__ void k(int* x) { x[0] = 1; }')


def test_a_cache_that_cannot_be_created_is_one_clear_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PAGEDINFER_CACHE", str(tmp_path / "file" / "kernels"))
    with pytest.raises(kernel_cache.KernelCacheError) as e:
        kernel_cache.folder()
    assert str(e.value) == (
        f"cannot create the kernel cache {tmp_path / 'file' / 'kernels'}: Not a directory "
        f"({tmp_path / 'file' / 'kernels'}); set PAGEDINFER_CACHE to a folder you can write"
    )
