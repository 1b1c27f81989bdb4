"""Thin setuptools shim: CMake builds libtransformer_engine.so and the _nvte module.

NVTE_FRAMEWORK=pytorch,jax,paddle | all | none chooses the framework adapters to
install (unset: those whose framework is importable). NVTE_WITH_CUDA=auto|ON|OFF and
NVTE_CUDA_ARCHS are passed to CMake; NVTE_BUILD_DIR overrides the build directory.
"""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
FRAMEWORKS = ("pytorch", "jax", "paddle")
FRAMEWORK_MODULE = {"pytorch": "torch", "jax": "jax", "paddle": "paddle"}


def selected_frameworks():
    raw = os.environ.get("NVTE_FRAMEWORK")
    if raw is None:
        return [f for f in FRAMEWORKS if importlib.util.find_spec(FRAMEWORK_MODULE[f]) is not None]
    names = [x.strip().lower() for x in raw.split(",") if x.strip()]
    if names == ["all"]:
        return list(FRAMEWORKS)
    if names == ["none"] or not names:
        return []
    unknown = [n for n in names if n not in FRAMEWORKS]
    if unknown:
        raise SystemExit(f"NVTE_FRAMEWORK: unknown framework(s) {unknown}; choose from {FRAMEWORKS}, all, none")
    return names


def packages_and_dirs():
    pkgs = {"transformer_engine": "bindings/python/transformer_engine"}
    for sub in sorted((ROOT / "bindings/python/transformer_engine").rglob("__init__.py")):
        rel = sub.parent.relative_to(ROOT / "bindings/python")
        pkgs[".".join(rel.parts)] = str(Path("bindings/python") / rel)
    for fw in selected_frameworks():
        adapter = ROOT / "bindings" / fw / "transformer_engine" / fw
        if not (adapter / "__init__.py").exists():
            print(f"setup.py: the {fw} adapter is not part of this version yet; skipping it")
            continue
        for sub in sorted(adapter.rglob("__init__.py")):
            rel = sub.parent.relative_to(ROOT / "bindings" / fw)
            pkgs[".".join(rel.parts)] = str(Path("bindings") / fw / rel)
    return pkgs


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("NVTE_BUILD_DIR", ROOT / "build" / "cmake"))
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DNVTE_WITH_CUDA={os.environ.get('NVTE_WITH_CUDA', 'auto')}",
            "-DNVTE_BUILD_PYTHON=ON",
            "-DNVTE_BUILD_TESTS=ON",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if os.environ.get("NVTE_CUDA_ARCHS"):
            args.append(f"-DNVTE_CUDA_ARCHS={os.environ['NVTE_CUDA_ARCHS']}")
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build_dir)] + args)
        jobs = os.environ.get("NVTE_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])
        out_dir.mkdir(parents=True, exist_ok=True)
        for pattern in ("libtransformer_engine.so*", "_nvte*.so"):
            for f in build_dir.glob(pattern):
                dst = out_dir / f.name
                if dst.exists() or dst.is_symlink():
                    dst.unlink()
                shutil.copy2(f, dst, follow_symlinks=True)
        inc = out_dir / "include"
        if inc.exists():
            shutil.rmtree(inc)
        shutil.copytree(ROOT / "include", inc)


pkg_dirs = packages_and_dirs()
setup(
    name="transformer_engine",
    version="0.1.0",
    description="FP8 / BF16 building blocks for transformers: C API with CPU and CUDA backends",
    packages=list(pkg_dirs),
    package_dir=pkg_dirs,
    ext_modules=[Extension("transformer_engine._nvte", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["numpy"],
    extras_require={
        "pytorch": ["torch>=2.4"],
        "jax": ["jax>=0.4.30", "jaxlib>=0.4.30", "flax"],
        "paddle": ["paddlepaddle>=3.0"],
        "test": ["pytest", "ml_dtypes>=0.5", "numpy"],
    },
    zip_safe=False,
)
