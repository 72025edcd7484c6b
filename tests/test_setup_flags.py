"""setup.py's per-platform build logic, checked from any platform: the macOS arm64 build
(sources, OpenMP from torch's libomp, arm64 only), Linux with GCC or clang, and aarch64."""

import glob
import importlib.util
import os
import platform
import subprocess
import sys
import tarfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIVERSAL2 = "-arch arm64 -arch x86_64"


def _load_setup(name="rlx_setup_under_test"):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines the functions, builds nothing
    return module


@pytest.fixture(scope="module")
def rlx_setup():
    return _load_setup()


def _macos(rlx_setup, **kw):
    args = dict(std="c++17", torch_openmp=True, use_mps=True)
    args.update(kw)
    return rlx_setup.build_flags("darwin", "arm64", "clang", **args)


def _linux(rlx_setup, machine, compiler, std="c++17", **kw):
    return rlx_setup.build_flags("linux", machine, compiler, std=std, torch_openmp=True,
                                 use_mps=False, **kw)


def _files(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def test_macos_sources_add_the_metal_host_code(rlx_setup):
    srcs, use_mps = rlx_setup.source_files(ROOT, "darwin", mps_built=True)
    mm = _files("csrc/mps/*.mm")
    assert use_mps and mm and set(mm) <= set(srcs)
    isa_copies = _files("csrc/cpu/avx2/*.cpp") + _files("csrc/cpu/avx512/*.cpp")
    assert isa_copies
    assert set(srcs) == set(_files("csrc/*.cpp") + _files("csrc/cpu/*.cpp") + isa_copies + mm)
    assert "csrc/ops.cpp" in srcs
    # without MPS in torch, or off macOS, the host code is left out
    for system, built in (("darwin", False), ("linux", True)):
        other, other_mps = rlx_setup.source_files(ROOT, system, mps_built=built)
        assert not other_mps and not set(mm) & set(other)
        assert set(other) == set(srcs) - set(mm)


def test_macos_uses_torchs_libomp(rlx_setup):
    flags = _macos(rlx_setup)
    cxx, link = flags["cxx"], flags["link"]
    # Apple's clang takes OpenMP only through the preprocessor; a bare -fopenmp is an error
    i = cxx.index("-fopenmp")
    assert cxx[i - 1] == "-Xpreprocessor" and cxx.count("-fopenmp") == 1
    assert "-fopenmp" not in link
    # the OpenMP calls bind at load time to the libomp libtorch_cpu loaded: no -lomp, which
    # would record torch 2.13's /opt/llvm-openmp/lib/libomp.dylib install name, or load a copy
    assert "-Wl,-undefined,dynamic_lookup" in link
    assert not any("omp" in f for f in link)
    assert link[:4] == ["-framework", "Metal", "-framework", "Foundation"]
    assert "-std=c++17" in cxx and "-O3" in cxx and "-Wall" in cxx and "-Wextra" in cxx
    # no x86 flags on Apple silicon
    assert not {"-mavx2", "-mfma"} & set(cxx)


def test_macos_without_openmp_or_mps(rlx_setup):
    flags = _macos(rlx_setup, torch_openmp=False, use_mps=False)
    assert "-fopenmp" not in flags["cxx"] and flags["link"] == []


def test_linux_gcc_uses_fopenmp_and_a_portable_x86_baseline(rlx_setup):
    flags = _linux(rlx_setup, "x86_64", "gcc", std="c++20")
    assert flags["cxx"].count("-fopenmp") == 1 and flags["link"] == ["-fopenmp"]
    assert "-Xpreprocessor" not in flags["cxx"] and "-std=c++20" in flags["cxx"]
    # plain x86-64: AVX2 only in the kernels' target regions (csrc/cpu/cpu_isa.h)
    assert not any(f.startswith(("-mavx", "-mfma", "-march", "-mtune")) for f in flags["cxx"])
    # flags that no benchmark showed to pay stay out (see build_flags)
    assert not {"-falign-loops=32", "-fno-wrapv"} & set(flags["cxx"])


def test_release_builds_have_no_debug_info(rlx_setup):
    # Python's CFLAGS (first on torch's command line) carry -g: the last -g* flag wins
    release = _linux(rlx_setup, "x86_64", "gcc")["cxx"]
    assert [f for f in release if f.startswith("-g")][-1:] == ["-g0"]
    assert [f for f in _macos(rlx_setup)["cxx"] if f.startswith("-g")][-1:] == ["-g0"]
    debug = _linux(rlx_setup, "x86_64", "gcc", debug=True)["cxx"]
    assert [f for f in debug if f.startswith("-g")][-1:] == ["-g"]
    sanitize = _linux(rlx_setup, "x86_64", "gcc", sanitize=True)["cxx"]
    assert [f for f in sanitize if f.startswith("-g")][-1:] == ["-g"]


def test_linux_aarch64_has_no_x86_flags(rlx_setup):
    flags = _linux(rlx_setup, "aarch64", "gcc")
    assert not any(f.startswith(("-mavx", "-mfma")) for f in flags["cxx"])
    assert "-fopenmp" in flags["cxx"]


def test_linux_clang_with_openmp_is_refused_unless_asked(rlx_setup):
    with pytest.raises(SystemExit, match="Build with GCC on Linux") as exc:
        _linux(rlx_setup, "x86_64", "clang")
    assert "libgomp" in str(exc.value) and "RLX_CLANG_OPENMP=1" in str(exc.value)
    flags = _linux(rlx_setup, "x86_64", "clang", clang_openmp=True)
    assert "-fopenmp" in flags["cxx"] and "-fopenmp" in flags["link"]


def test_cxx_standard_follows_torch():
    rlx_setup = _load_setup()
    assert rlx_setup.cxx_standard("2.5.0") == "c++17"
    assert rlx_setup.cxx_standard("2.9.1+cpu") == "c++17"
    assert rlx_setup.cxx_standard("2.10.0") == "c++20"
    assert rlx_setup.cxx_standard("2.13.0+cpu") == "c++20"
    assert rlx_setup.cxx_standard("3.0.0") == "c++20"


def test_this_platforms_extension_matches_the_plan(rlx_setup):
    ext = rlx_setup._extension()
    cxx = ext.extra_compile_args["cxx"]
    assert any(f.startswith("-std=c++") for f in cxx)  # explicit, not torch's default
    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        assert "-fopenmp" in cxx and "-fopenmp" in ext.extra_link_args
    assert "-mavx2" not in cxx and "-g0" in cxx


def test_macos_builds_arm64_only(monkeypatch):
    from distutils import sysconfig

    # A universal2 Python: the flags distutils makes the compiler and linker commands from.
    universal2 = {"CFLAGS": f"-O3 {UNIVERSAL2} -fwrapv", "LDFLAGS": UNIVERSAL2,
                  "LDSHARED": f"clang -bundle -undefined dynamic_lookup {UNIVERSAL2}",
                  "CC": "clang", "CXX": "clang++", "SIZEOF_VOID_P": 8}
    monkeypatch.setattr(sysconfig, "_config_vars", dict(universal2))
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(platform, "machine", lambda: "arm64")
    _load_setup("rlx_setup_darwin")
    fixed = sysconfig.get_config_vars()
    for key in ("CFLAGS", "LDFLAGS", "LDSHARED"):
        assert "x86_64" not in fixed[key] and fixed[key].count("-arch arm64") == 1, key
    assert fixed["CFLAGS"].startswith("-O3 -fwrapv")
    assert fixed["LDSHARED"].startswith("clang -bundle -undefined dynamic_lookup")
    assert fixed["CC"] == "clang" and fixed["SIZEOF_VOID_P"] == 8
    # an x86_64 Python (Rosetta) is refused with the reason
    monkeypatch.setattr(sysconfig, "_config_vars", dict(universal2))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    with pytest.raises(SystemExit, match="arm64"):
        _load_setup("rlx_setup_rosetta")


def test_sdist_holds_every_source(tmp_path):
    """The sdist builds the extension on its own: csrc/ (C++, headers, .mm, .metal), tools/."""
    import subprocess

    # a fresh egg-info outside the tree: a stale SOURCES.txt would stand in for MANIFEST.in
    egg_base = tmp_path / "egg"
    egg_base.mkdir()
    command = [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(egg_base),
               "sdist", "-d", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = set()
    for folder in ("csrc", "tools"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__pycache__" not in dirpath:
                wanted |= {os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files}
    wanted |= {"setup.py", "pyproject.toml", "README.md", "LICENSE-MIT", "LICENSE-APACHE"}
    assert any(n.endswith(".metal") for n in wanted) and any(n.endswith(".mm") for n in wanted)
    assert any(n.endswith(".h") for n in wanted)
    missing = sorted(wanted - names)
    assert not missing, f"missing from the sdist: {missing}"
    # generated and build files stay out
    assert not any(n.startswith(("build/", ".venv/")) or n.endswith((".so", ".o")) for n in names)


def test_cross_build_finds_the_wheels_bundled_openmp_and_version(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import cross_build

    torch_dir = tmp_path / "torch"
    torch_dir.mkdir()
    (torch_dir / "version.py").write_text("__version__ = '2.9.1+cpu'\ngit_version = 'x'\n")
    assert cross_build._torch_version(str(torch_dir)) == "2.9.1+cpu"
    assert cross_build._openmp_runtime(str(torch_dir)) is None  # torch/lib's own libgomp.so.1
    (tmp_path / "torch.libs").mkdir()
    bundled = tmp_path / "torch.libs" / "libgomp-a49a47f9.so.1.0.0"
    bundled.write_bytes(b"")
    assert cross_build._openmp_runtime(str(torch_dir)) == str(bundled)


def test_release_builds_carry_no_debug_info(rlx_setup):
    args = dict(std="c++20", torch_openmp=True, use_mps=False)
    release = rlx_setup.build_flags("linux", "x86_64", "gcc", **args)["cxx"]
    debug = rlx_setup.build_flags("linux", "x86_64", "gcc", debug=True, **args)["cxx"]
    sanitize = rlx_setup.build_flags("linux", "x86_64", "gcc", sanitize=True, **args)["cxx"]
    # -g0 comes after Python's sysconfig -g in the compile line, so it wins
    assert "-g0" in release and "-g" not in release
    assert "-g" in debug and "-g0" not in debug
    assert "-g" in sanitize and "-g0" not in sanitize


def test_precompiled_torch_headers_only_with_gcc_on_linux(rlx_setup):
    assert rlx_setup.pch_flags("gcc", "linux", "/b/pch/torch_headers.h") == [
        "-include", "/b/pch/torch_headers.h", "-Winvalid-pch"]
    # clang (macOS, the Linux clang check) and a failed precompile: each file parses the headers
    assert rlx_setup.pch_flags("clang", "darwin", "/b/pch/torch_headers.h") == []
    assert rlx_setup.pch_flags("clang", "linux", "/b/pch/torch_headers.h") == []
    assert rlx_setup.pch_flags("gcc", "linux", None) == []
    # the header is the one the kernel files include, and it guards itself by macro: the
    # precompiled copy is included under another path, where #pragma once would not match
    text = open(os.path.join(ROOT, rlx_setup.PCH_HEADER)).read()
    assert "#ifndef RLX_CPU_TORCH_HEADERS_H" in text
    assert not any(line.startswith("#pragma once") for line in text.splitlines())
    deps = open(os.path.join(ROOT, "csrc", "cpu", "cpu_kernel_deps.h")).read()
    assert '#include "torch_headers.h"' in deps


def test_precompiled_header_is_built_once_per_command_and_used(rlx_setup, tmp_path):
    cxx = os.environ.get("CXX", "c++")
    if rlx_setup.compiler_family(cxx) != "gcc":  # Apple's c++ is clang: no precompiled header
        assert rlx_setup.pch_flags(rlx_setup.compiler_family(cxx), sys.platform, "/h.h") == []
        return
    header = tmp_path / "h.h"
    header.write_text("#ifndef H_H\n#define H_H\ninline int answer() { return 42; }\n#endif\n")
    out = tmp_path / "pch"
    cmd = [*cxx.split(), "-O2", "-std=c++17"]
    copy = rlx_setup._build_pch(cmd, str(header), str(out))
    gch = out / "h.h.gch"
    assert copy == str(out / "h.h") and gch.exists()
    first = gch.stat().st_mtime_ns
    assert rlx_setup._build_pch(cmd, str(header), str(out)) == copy
    assert gch.stat().st_mtime_ns == first  # same command and text: not rebuilt
    # a file compiled with the same flags uses it (-Winvalid-pch -Werror: no silent fallback)
    src = tmp_path / "a.cpp"
    src.write_text('#include "h.h"\nint main() { return answer() == 42 ? 0 : 1; }\n')
    exe = tmp_path / "a"
    run = subprocess.run([*cmd, *rlx_setup.pch_flags("gcc", sys.platform, copy), "-Werror",
                          "-H", str(src), "-o", str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "h.h.gch" in run.stderr  # -H names the precompiled header it read
    assert subprocess.run([str(exe)]).returncode == 0
    # other flags: rebuilt for them
    assert rlx_setup._build_pch([*cmd, "-DX=1"], str(header), str(out)) == copy
    assert gch.stat().st_mtime_ns != first
