// What sources a build of this extension was compiled from (NOTE(source-hash) in build_spec.py).
#pragma once

#include <string>

// setup.py and the JIT build pass -DSLUICE_SOURCE_HASH=sh_<hex>: a digest of the
// extension's sources, every header of csrc/ and its flags.  sluice.kernels.ext
// compares it with the digest of the sources installed beside it, and compiles
// those instead when they differ (a build left over from older sources).
#ifndef SLUICE_SOURCE_HASH
#define SLUICE_SOURCE_HASH unknown
#endif
#define SLUICE_STRINGIFY_(x) #x
#define SLUICE_STRINGIFY(x) SLUICE_STRINGIFY_(x)

#define SLUICE_BIND_SOURCE_HASH(m)                                                                            \
  m.def("source_hash", [] { return std::string(SLUICE_STRINGIFY(SLUICE_SOURCE_HASH)); },                    \
        "the digest of the sources this module was compiled from (NOTE(source-hash))")
