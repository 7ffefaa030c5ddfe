"""Build sluice's C++ extensions at install time (metadata lives in pyproject.toml).

With torch importable (``pip install --no-build-isolation``, as the Makefile
does), each extension in ``sluice/kernels/build_spec.py`` is compiled here.
Without torch or a compiler, the package still installs and
``sluice.kernels.ext`` compiles the kernels on first use instead.
"""

import os
import runpy

from setuptools import setup

spec = runpy.run_path(os.path.join("sluice", "kernels", "build_spec.py"))
ext_modules = []
cmdclass = {}
if os.environ.get("SLUICE_SKIP_EXT_BUILD") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # no torch in the build environment: JIT at first use
        pass
    else:
        for module, files, flags in spec["EXTENSIONS"].values():
            ext_modules.append(
                CppExtension(
                    module,
                    [os.path.join(spec["CSRC"], f) for f in files],
                    extra_compile_args=flags,
                    extra_link_args=["-fopenmp"],
                )
            )
        cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=False)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
