// SG_HD marks code that runs on the host and, compiled by nvcc, on a CUDA device too: the per-element
// work of every CUDA kernel is written once, so the host test harness runs exactly the index
// arithmetic and conversions the device runs (kernels/cuda/elements.hpp). Plain C++ compilers see
// nothing.
#pragma once

#if defined(__CUDACC__)
#define SG_HD __host__ __device__
#else
#define SG_HD
#endif
