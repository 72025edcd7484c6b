// The AVX-512 copy of ../codebook_gather.cpp (cpu_isa.h explains the copies): the float16 /
// bfloat16 codebook gather forward with two groups per 512-bit vector.
#if defined(__x86_64__) || defined(_M_X64)
#define RLX_ISA_AVX512_COPY 1
#include "../codebook_gather.cpp"
#endif
