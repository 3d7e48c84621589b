"""Build of the native CPU kernels (quantized matmuls, specsamp/quant/qkernels.cc, and
cache attention, specsamp/quant/attention.cc, the sampling path's row reductions,
specsamp/quant/reduce.cc), and the shim
for Beam's `--setup_file ./setup.py` (Dataflow workers install the project from an sdist
built by it); all other metadata lives in pyproject.toml. TPU workers use the Dockerfile.

The kernels are compiled from source with the machine's C++ compiler against the XLA FFI
headers that ship with jaxlib. They are optional: where the build fails (no compiler, no
jaxlib headers) the install goes on and specsamp computes with its pure-XLA path."""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _ffi_include() -> str | None:
    try:
        import jaxlib
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(jaxlib.__file__), "include")
    return path if os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")) else None


class OptionalBuildExt(build_ext):
    """build_ext that adds jaxlib's FFI headers and never fails the install."""

    def build_extension(self, ext):
        include = _ffi_include()
        if include is None:
            print("specsamp: jaxlib's FFI headers not found; native kernels not built "
                  "(the XLA path is used)", file=sys.stderr)
            return
        ext.include_dirs.append(include)
        try:
            super().build_extension(ext)
        except Exception as e:  # a compiler error must not stop the install
            print(f"specsamp: native kernels not built ({e}); the XLA path is used",
                  file=sys.stderr)


KERNELS = Extension(
    "specsamp.quant._qkernels",
    sources=["specsamp/quant/qkernels.cc", "specsamp/quant/attention.cc", "specsamp/quant/reduce.cc"],
    depends=["specsamp/quant/cpu.h", "specsamp/quant/half.h", "specsamp/quant/parallel.h",
             "specsamp/quant/q4gemm.h", "specsamp/quant/amx.h", "specsamp/quant/a8.h"],
    language="c++",
    # Vector code is selected per function at run time (AVX-512 / AVX2 / portable), so
    # no -march flag: the library runs on any x86-64 (and builds elsewhere, portable).
    # (-Wno-maybe-uninitialized: GCC 12 flags the undefined pass-through vector inside
    # its own unmasked AVX-512 conversion intrinsics, a false positive.)
    extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes",
                        "-Wno-return-type", "-Wno-maybe-uninitialized"],
)

setup(ext_modules=[KERNELS], cmdclass={"build_ext": OptionalBuildExt})
