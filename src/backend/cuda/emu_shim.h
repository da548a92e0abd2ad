// Host emulation of the CUDA features that kernels.cu uses, so that the kernels can run on a
// CPU in tests (src/backend/cuda/emu.rs compiles kernels.cu with this header in front).
//
// A launch runs its blocks one after another. The threads of a block are cooperative fibers
// on the calling thread: each runs until __syncthreads() and yields, the scheduler
// resumes them in turn, so a barrier is a round of the scheduler, and __shared__ memory (a
// static local) is shared by all threads of the block. Kernels must reach every barrier with
// every thread of the block, as on a GPU. __shfl_xor_sync is emulated with two scheduler
// rounds (all lanes publish, then all read their partner's value): correct for the warp-uniform
// control flow kernels.cu uses (every lane of a warp reaches each shuffle), with no barrier
// between warps.

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <setjmp.h>
#include <ucontext.h>

#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

struct fugu_dim3 {
    unsigned x, y, z;
};
static fugu_dim3 threadIdx, blockIdx, blockDim, gridDim;

// jmp_buf is an array type; a struct makes it storable in a vector.
struct jmp_buf_wrapper {
    jmp_buf jb;
};

namespace fugu_emu {
const size_t STACK = 64 * 1024;
// Fibers start through makecontext/swapcontext (once each) and then switch with
// _setjmp/_longjmp, which, unlike swapcontext, make no signal-mask system call.
static ucontext_t sched_uc;
static jmp_buf sched_jb;
static std::vector<ucontext_t> fibers;
static std::vector<jmp_buf_wrapper> fiber_jb;
static std::vector<char> stacks;
static std::vector<int> done, started;
static unsigned cur;
static void (*body)(void**);
static void** body_args;
static std::vector<double> dyn_shared;

static void fiber_main() {
    body(body_args);
    done[cur] = 1;
    _longjmp(sched_jb, 1);
}

// Yields to the scheduler; returns when the scheduler resumes this fiber.
static inline void yield() {
    if (!_setjmp(fiber_jb[cur].jb)) _longjmp(sched_jb, 1);
}

template <typename... A, size_t... I>
void invoke_impl(void (*f)(A...), void** a, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(a[I])...);
}

template <typename... A>
void call(void (*f)(A...), void** a) {
    invoke_impl(f, a, std::index_sequence_for<A...>{});
}

template <auto F>
void invoke(void** a) {
    call(F, a);
}

// 256 KB after a launch's dynamic shared memory filled with GUARD_BYTE: a kernel that writes
// into them wrote past what the host gave it (the launch then fails; reads are not checked).
constexpr unsigned GUARD = 1u << 18;
constexpr unsigned char GUARD_BYTE = 0xA5;

// Runs kernel F on `grid` blocks of `block` threads; `args` points at each argument's value.
// Returns 0, or 2 where the kernel wrote past its `shmem` bytes of dynamic shared memory.
template <auto F>
int run(unsigned grid, unsigned block, unsigned shmem, void** args) {
    body = &invoke<F>;
    body_args = args;
    dyn_shared.assign((shmem + GUARD) / sizeof(double) + 1, 0.0);
    unsigned char* guard = reinterpret_cast<unsigned char*>(dyn_shared.data()) + shmem;
    memset(guard, GUARD_BYTE, GUARD);
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    fibers.resize(block);
    fiber_jb.resize(block);
    stacks.resize((size_t)block * STACK);
    ucontext_t proto;
    getcontext(&proto);
    for (unsigned b = 0; b < grid; b++) {
        blockIdx = {b, 0, 0};
        done.assign(block, 0);
        started.assign(block, 0);
        unsigned live = block;
        while (live > 0) {
            for (unsigned i = 0; i < block; i++) {
                if (done[i]) continue;
                cur = i;
                threadIdx = {i, 0, 0};
                if (!_setjmp(sched_jb)) {
                    if (started[i]) _longjmp(fiber_jb[i].jb, 1);
                    started[i] = 1;
                    fibers[i] = proto;
                    fibers[i].uc_stack.ss_sp = &stacks[(size_t)i * STACK];
                    fibers[i].uc_stack.ss_size = STACK;
                    fibers[i].uc_link = nullptr;
                    makecontext(&fibers[i], fiber_main, 0);
                    swapcontext(&sched_uc, &fibers[i]);
                }
                // Back here by _longjmp(sched_jb) from a yield or a finished fiber.
                if (done[i]) live--;
            }
        }
    }
    for (unsigned i = 0; i < GUARD; i++)
        if (guard[i] != GUARD_BYTE) return 2;
    return 0;
}

typedef int (*launcher)(unsigned, unsigned, unsigned, void**);
}  // namespace fugu_emu

static inline void __syncthreads() { fugu_emu::yield(); }

namespace fugu_emu {
static std::vector<double> shfl_slots;
}

template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
    fugu_emu::shfl_slots.resize(blockDim.x);
    fugu_emu::shfl_slots[threadIdx.x] = (double)v;  // float and double both convert exactly
    fugu_emu::yield();
    T r = (T)fugu_emu::shfl_slots[threadIdx.x ^ (unsigned)lane_mask];
    fugu_emu::yield();
    return r;
}

// Warp-collective helpers for kernels.cu's emulated mma: every lane of a warp (or of a group of
// `lanes` threads) publishes up to FUGU_EMU_WARP_WORDS words, waits one scheduler round (the
// whole warp has published), reads the warp's 32 × FUGU_EMU_WARP_WORDS words, and releases
// them with a second round, as __shfl_xor_sync does.
#define FUGU_EMU_WARP_WORDS 8
namespace fugu_emu {
static std::vector<unsigned> warp_words;
}
// `lanes` consecutive threads (32, a warp; or a warpgroup's 128 for the emulated wgmma), every
// one of which must reach the call.
static inline const unsigned* fugu_emu_lanes_publish(const unsigned* w, int n, unsigned lanes) {
    fugu_emu::warp_words.resize((size_t)blockDim.x * FUGU_EMU_WARP_WORDS);
    memcpy(&fugu_emu::warp_words[(size_t)threadIdx.x * FUGU_EMU_WARP_WORDS], w,
           (size_t)n * sizeof *w);
    fugu_emu::yield();
    return &fugu_emu::warp_words[(size_t)(threadIdx.x / lanes * lanes) * FUGU_EMU_WARP_WORDS];
}
static inline const unsigned* fugu_emu_warp_publish(const unsigned* w, int n) {
    return fugu_emu_lanes_publish(w, n, 32);
}
static inline void fugu_emu_warp_release() { fugu_emu::yield(); }

static inline float __int_as_float(int x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static inline float __uint_as_float(unsigned x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static inline unsigned __float_as_uint(float f) {
    unsigned x;
    memcpy(&x, &f, sizeof x);
    return x;
}

// A product rounded on its own (the emulator compiles with -ffp-contract=off: every product is).
static inline float __fmul_rn(float a, float b) { return a * b; }

// Global-memory access and ordering between blocks. Blocks run one after another here, so a
// fence orders nothing and an atomic is a plain read-modify-write.
static inline void __threadfence() {}
static inline int atomicAdd(int* p, int v) {
    int old = *p;
    *p = old + v;
    return old;
}
static inline float __ldcg(const float* p) { return *p; }
static inline void __stcg(float* p, float v) { *p = v; }

#define __global__
#define __launch_bounds__(...)
#define __device__ static inline
#define __shared__ static
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(fugu_emu::dyn_shared.data())
