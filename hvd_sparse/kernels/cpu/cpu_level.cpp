// Which build of this library the CPU can run: the loader (_library.py) asks the baseline build
// before it loads the x86-64-v3 one.
#include <cstdint>

extern "C" {

// 3 when the CPU has every x86-64-v3 feature (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE), 1 for any
// other x86-64 CPU, 0 on another architecture.
int hvd_sparse_x86_64_level() {
#if defined(__x86_64__) && defined(__clang__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")
        ? 3 : 1;
#elif defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v3") ? 3 : 1;
#else
    return 0;
#endif
}

}  // extern "C"
