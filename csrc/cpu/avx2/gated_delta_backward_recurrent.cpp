// The AVX2+FMA copy of ../gated_delta_backward_recurrent.cpp (cpu_isa.h explains the two copies).
#if defined(__x86_64__) || defined(_M_X64)
#define RLX_ISA_AVX2_COPY 1
#include "../gated_delta_backward_recurrent.cpp"
#endif
