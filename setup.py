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
        # NOTE(parallel-ext): the largest extension (quant, five sources) first, so it starts at once
        for name, (module, files, flags) in sorted(spec["EXTENSIONS"].items(), key=lambda e: -len(e[1][1])):
            digest = spec["source_hash"](name)  # NOTE(source-hash): ext.load checks it against the sources
            ext_modules.append(
                CppExtension(
                    module,
                    [os.path.join(spec["CSRC"], f) for f in files],
                    extra_compile_args=[*flags, f"-D{spec['SOURCE_HASH_MACRO']}={digest}"],
                    extra_link_args=["-fopenmp"],
                )
            )

        class ParallelBuildExtension(BuildExtension.with_options(use_ninja=False)):
            """NOTE(parallel-ext): the extensions compile side by side, one per core (each source that
            includes torch's headers takes ~35-45 s; one after the other they were ~220 of a fresh
            `make test`'s ~280 s of set-up on 2 cores).

            Set here rather than through ``setup(options=...)``: pip's editable install
            (``pip install -e``, the Makefile's) does not pass that option on.
            """

            def finalize_options(self) -> None:
                super().finalize_options()
                if not self.parallel:
                    self.parallel = os.cpu_count() or 1

        cmdclass["build_ext"] = ParallelBuildExtension

setup(ext_modules=ext_modules, cmdclass=cmdclass)
