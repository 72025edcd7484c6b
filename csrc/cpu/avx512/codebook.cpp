// The AVX-512 copy of ../codebook.cpp (cpu_isa.h explains the copies): the uint8 forward's
// lookup-table kernel with 512-bit vectors and register-resident one-row tables.
#if defined(__x86_64__) || defined(_M_X64)
#define RLX_ISA_AVX512_COPY 1
#include "../codebook.cpp"
#endif
