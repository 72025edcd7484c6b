// The AVX2+FMA copy of ../codebook_packed.cpp (cpu_isa.h explains the two copies).
#if defined(__x86_64__) || defined(_M_X64)
#define RLX_ISA_AVX2_COPY 1
#include "../codebook_packed.cpp"
#endif
