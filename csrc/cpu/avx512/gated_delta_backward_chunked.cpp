// The AVX-512 copy of ../gated_delta_backward_chunked.cpp (cpu_isa.h explains the copies),
// on 512-bit vectors (RLX_VEC_512, vec.h).
#if defined(__x86_64__) || defined(_M_X64)
#define RLX_ISA_AVX512_COPY 1
#define RLX_VEC_512 1
#include "../gated_delta_backward_chunked.cpp"
#endif
