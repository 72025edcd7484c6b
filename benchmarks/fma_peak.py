"""The CPU's float32 fused multiply-add peak, on one core and on every core at once.

    python benchmarks/fma_peak.py [--threads N] [--seconds S]

A few lines of C (compiled here with the system C compiler, ``cc``, for the host CPU) keep
independent FMA chains on the widest vectors the compiler targets (AVX-512, AVX2 or NEON;
enough chains to cover the FMA latency of two pipes), so nothing but the FMA units bounds
them. Each thread is a separate process pinned to one CPU where the OS allows it. The figure
is an upper bound for any float32 kernel on this machine: the benchmarks quote it when a
target would need more arithmetic per second than the CPU has. Prints the CPU, the figures
and one JSON line.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_summary, emit_json  # noqa: E402

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
#define CHAINS 12
typedef float vec __attribute__((vector_size(LANES * 4)));

int main(int argc, char **argv) {
    double seconds = atof(argv[1]);
    vec acc[CHAINS], mul, add;
    for (int i = 0; i < LANES; ++i) { mul[i] = 0.999999f; add[i] = 1e-7f; }
    for (int c = 0; c < CHAINS; ++c) acc[c] = add * (float)(c + 1);
    long rounds = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double elapsed = 0;
    while (elapsed < seconds) {
        for (int r = 0; r < 1000000; ++r) {
            for (int c = 0; c < CHAINS; ++c) acc[c] = acc[c] * mul + add;
        }
        rounds += 1000000;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        elapsed = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    }
    float sum = 0;
    for (int c = 0; c < CHAINS; ++c) for (int i = 0; i < LANES; ++i) sum += acc[c][i];
    printf("%.3f %d %g\n", 2.0 * LANES * CHAINS * rounds / elapsed / 1e9, LANES, sum);
    return 0;
}
"""


def build(folder: Path) -> Path:
    """Compiles the FMA loop for the host CPU and returns the executable."""
    src, exe = folder / "fma_peak.c", folder / "fma_peak"
    src.write_text(SOURCE)
    flags = ["-O3", "-march=native", "-ffp-contract=fast"]
    subprocess.run(["cc", *flags, str(src), "-o", str(exe)], check=True)
    asm = subprocess.run(["cc", *flags, "-S", "-o", "-", str(src)], check=True,
                         capture_output=True, text=True).stdout
    if "fma" not in asm.lower() and "fmla" not in asm.lower():
        raise RuntimeError("the compiler emitted no fused multiply-add for the loop")
    return exe


def run(exe: Path, processes: int, seconds: float) -> list[float]:
    """GFLOP/s of each of ``processes`` copies running at once, one per CPU if possible."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def pin(i: int):
        if cpus:
            return lambda: os.sched_setaffinity(0, {cpus[i % len(cpus)]})
        return None

    procs = [subprocess.Popen([str(exe), str(seconds)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=pin(i)) for i in range(processes)]
    return [float(p.communicate()[0].split()[0]) for p in procs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        exe = build(Path(folder))
        one = max(run(exe, 1, args.seconds) for _ in range(3))[0]
        every = run(exe, args.threads, args.seconds)
    print(cpu_summary())
    print(f"float32 FMA peak: one core {one:.1f} GFLOP/s; {args.threads} cores at once "
          f"{sum(every):.1f} GFLOP/s ({', '.join(f'{g:.1f}' for g in every)})")
    emit_json({"bench": "fma_peak", "cpu": cpu_summary(), "one_core_gflops": round(one, 1),
               "cores": args.threads, "all_cores_gflops": round(sum(every), 1)})


if __name__ == "__main__":
    main()
