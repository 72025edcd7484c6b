// The AVX2+FMA copy of ../muon_update.cpp (cpu_isa.h explains the two copies).
#if defined(__x86_64__) || defined(_M_X64)
#define RLX_ISA_AVX2_COPY 1
#include "../muon_update.cpp"
#endif
