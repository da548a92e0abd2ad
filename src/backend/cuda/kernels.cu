// fugu's CUDA kernels: every Backend op that is not a GEMM (the GEMMs go to cuBLAS), and fused
// causal attention on the tensor cores for the 16-bit types (the "fused (flash) attention"
// section).
//
// Compiled at run time by NVRTC (src/backend/cuda/mod.rs), with --fmad=false so that no
// multiply-add is contracted into an FMA the CPU reference does not use. The semantics of each
// kernel are those of the CPU op it names in src/ops/ (shapes, overwrite vs +=); the comments
// here say only how the work is split.
//
// Determinism: no floating-point atomics. Every reduction has a fixed shape (fixed block size,
// fixed tree, fixed chunking of rows), so a run is bit-reproducible on the same GPU. (The one
// atomic, in the fused attention's one-kernel backward, hands out work items; which block
// takes an item does not change what it computes.) Statistics that the CPU accumulates in f64
// (layernorm mean/variance and its backward row sums, softmax and cross-entropy sums of
// exponentials, sum of squares) are accumulated in double here too.
//
// Launch shapes are chosen by the host: "row" kernels use one block of ROW_THREADS threads per
// row (a grid-stride loop over rows), "warp-row" kernels one warp per row (WARPS_PER_BLOCK
// rows per block), elementwise kernels a grid-stride loop over elements.

#define ROW_THREADS 256

// Dynamic shared memory (the host emulator, src/backend/cuda/emu_shim.h, defines its own).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef long long i64;

// ---- storage types ------------------------------------------------------------------------
//
// Every kernel is a template over T, the storage type of the tensors it is about (activations,
// or gradients for the gradient-only kernels), instantiated for float, bf16 and f16 by
// FOR_TYPES as `<name>_f32`, `<name>_bf16`, `<name>_f16` (the names the host launches).
// Statistics (layernorm mean/rstd, softmax and cross-entropy maxima, sums and losses) and
// parameter gradients written by the backward kernels are float whatever T is. All arithmetic
// is float (double where noted): `ld` widens a stored value exactly, `st` rounds to nearest
// even, as the CPU backend's low-precision storage does (src/dtype.rs).

struct bf16 {
    unsigned short bits;
};
struct f16 {
    unsigned short bits;
};

__device__ float ld(float x) { return x; }
__device__ void st(float& d, float x) { d = x; }

__device__ float ld(bf16 x) { return __uint_as_float((u32)x.bits << 16); }
__device__ void st(bf16& d, float x) {
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 800
    // One instruction on sm_80 and newer, the same rounding (a NaN becomes the canonical
    // 0x7fff there, its payload not kept as below and on the CPU: the only difference).
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    d.bits = h;
#else
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the payload's top bits, stay NaN
        unsigned short h = (unsigned short)(u >> 16);
        d.bits = (h & 0x7f) ? h : (unsigned short)(h | 0x40);
        return;
    }
    d.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

#ifdef __CUDACC_RTC__
__device__ float ld(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ void st(f16& d, float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    d.bits = h;
}
#else
// The host emulator: the same conversions in software (src/dtype.rs's, in C).
__device__ float ld(f16 x) {
    u32 h = x.bits, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
}
__device__ void st(f16& d, float x) {
    u32 b = __float_as_uint(x), sign = (b >> 16) & 0x8000u, man = b & 0x7fffffu;
    int exp = (int)((b >> 23) & 0xff);
    if (exp == 0xff) {
        u32 m = man >> 13;
        d.bits = (unsigned short)(sign | 0x7c00u | ((man != 0 && m == 0) ? 0x200u : m));
        return;
    }
    int e = exp - 112;
    if (e >= 0x1f) {
        d.bits = (unsigned short)(sign | 0x7c00u);
        return;
    }
    if (e <= 0) {
        if (e < -10) {
            d.bits = (unsigned short)sign;
            return;
        }
        u32 mm = man | 0x800000u, shift = (u32)(14 - e), v = mm >> shift,
            rem = mm & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (v & 1))) v++;
        d.bits = (unsigned short)(sign | v);
        return;
    }
    u32 v = ((u32)e << 10) | (man >> 13), rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (v & 1))) v++;
    d.bits = (unsigned short)(sign | v);
}
#endif

#define FOR_TYPES(X) X(f32, float) X(bf16, bf16) X(f16, f16)

// ---- 16-byte packs (the memory access of the elementwise, cross-entropy, layernorm kernels) -
//
// A Pack<T> is 16 bytes of T (4 floats or 8 16-bit values), moved as one 128-bit access: a
// warp then moves 512 bytes per load instruction instead of 64 (16-bit T) or 128 (float).
// These kernels are bound by how many bytes are in flight: with 2-byte loads a full H200
// kept about 1.5 TB/s of its 4.8 (GELU: 4.1 ms for 6 GB per GPT-2 124M B=16 step, docs/
// TRAINING.md). Packs change only how elements are fetched and stored, never the arithmetic
// of an element: elementwise results are bit-identical to the element-by-element form (row
// sums add the same terms, in another fixed order, so runs stay reproducible). A call works in
// packs where all its pointers (and, for rows, the row stride) are 16-byte aligned (whole
// allocations are; spans inside them usually are), element by element otherwise, and
// elements past the last whole pack (the tail) one by one.
template <typename T>
struct alignas(16) Pack {
    T v[16 / sizeof(T)];
};
#define PACK(T) ((int)(16 / sizeof(T)))

template <typename T>
__device__ Pack<T> ld_pack(const T* p) {
    return *reinterpret_cast<const Pack<T>*>(p);
}
template <typename T>
__device__ void st_pack(T* p, const Pack<T>& x) {
    *reinterpret_cast<Pack<T>*>(p) = x;
}
__device__ bool aligned16(const void* p) { return ((unsigned long long)p & 15) == 0; }

// Whether every pointer is 16-byte aligned.
template <typename... Ptrs>
__device__ bool all_aligned16(const Ptrs*... ps) {
    return (aligned16(ps) && ...);
}

// How many whole packs of T the first n elements hold when `vec` (0 otherwise).
template <typename T>
__device__ i64 whole_packs(i64 n, bool vec) {
    return vec ? n / PACK(T) : 0;
}

// The two loops every packed kernel is made of. Index c in 0 .. n of one or more arrays of T
// (`ins`) is visited by the thread whose `first` (its lane, thread or grid index) equals c's
// pack index k = c / P modulo `step` (the warp, block or grid size), P elements per visit,
// where `vec`; the same split by element otherwise and past the last whole pack.
//
// f(c, ld(v[0].v[j]), ld(v[1].v[j]), ...): element j of each loaded pack, in order.
template <int... I>
struct Seq {};
template <int N, int... I>
struct MakeSeq : MakeSeq<N - 1, N - 1, I...> {};
template <int... I>
struct MakeSeq<0, I...> {
    typedef Seq<I...> type;
};
template <typename T, int N, typename F, int... I>
__device__ decltype(auto) apply_at(F& f, i64 c, const Pack<T> (&v)[N], int j, Seq<I...>) {
    return f(c, ld(v[I].v[j])...);
}

// Packs of each array a thread loads before using the first, per step of the two loops: the
// loads of a row kernel's thread (dozens of steps per row) go out U at a time instead of one
// behind the work on the last, about 64 bytes in flight per thread whatever the number of
// arrays. The visits keep their order (pack k, k + step, ...), so sums add the same terms in
// the same order. (Elementwise launches give a thread one pack: U changes nothing there.)
template <int N>
__device__ constexpr int packs_ahead() {
    return N >= 4 ? 1 : 4 / N;
}
template <typename T, int N, typename... In>
__device__ void load_packs(Pack<T> (&v)[N], i64 at, const In*... ins) {
    Pack<T> t[] = {ld_pack(ins + at)...};
#pragma unroll
    for (int i = 0; i < N; i++) v[i] = t[i];
}

// The packed loop of both: g(k, v) for each whole pack k this thread visits (v: pack k of each
// array), the packs loaded U at a time ahead of their use; returns the count of whole packs
// (the callers visit the elements past them one by one).
template <typename T, typename G, typename... In>
__device__ i64 each_pack(i64 n, bool vec, i64 first, i64 step, G g, const In*... ins) {
    const int P = PACK(T);
    constexpr int N = sizeof...(In), U = packs_ahead<N>();
    i64 packs = whole_packs<T>(n, vec);
    i64 k = first;
    for (; k + (U - 1) * step < packs; k += U * step) {
        Pack<T> v[U][N];
#pragma unroll
        for (int u = 0; u < U; u++) load_packs(v[u], (k + u * step) * P, ins...);
#pragma unroll
        for (int u = 0; u < U; u++) g(k + u * step, v[u]);
    }
    for (; k < packs; k += step) {
        Pack<T> v[N];
        load_packs(v, k * P, ins...);
        g(k, v);
    }
    return packs;
}

// for_each_elem: f(c, ins[c]...), values widened by `ld`.
template <typename T, typename F, typename... In>
__device__ void for_each_elem(i64 n, bool vec, i64 first, i64 step, F f, const In*... ins) {
    const int P = PACK(T);
    constexpr int N = sizeof...(In);
    i64 packs = each_pack<T>(n, vec, first, step, [&](i64 k, const Pack<T> (&v)[N]) {
        for (int j = 0; j < P; j++)
            apply_at<T>(f, k * P + j, v, j, typename MakeSeq<N>::type());
    }, ins...);
    for (i64 c = packs * P + first; c < n; c += step) f(c, ld(ins[c])...);
}

// map_elems: out[c] = f(c, ins[c]...), rounded by `st` (`out` may be one of `ins`).
template <typename T, typename F, typename... In>
__device__ void map_elems(T* out, i64 n, bool vec, i64 first, i64 step, F f, const In*... ins) {
    const int P = PACK(T);
    constexpr int N = sizeof...(In);
    i64 packs = each_pack<T>(n, vec, first, step, [&](i64 k, const Pack<T> (&v)[N]) {
        Pack<T> o;
        for (int j = 0; j < P; j++)
            st(o.v[j], apply_at<T>(f, k * P + j, v, j, typename MakeSeq<N>::type()));
        st_pack(out + k * P, o);
    }, ins...);
    for (i64 c = packs * P + first; c < n; c += step) st(out[c], f(c, ld(ins[c])...));
}

// The grid-stride index of this thread and the grid's stride (elementwise kernels).
#define GRID_STRIDE(i, stride)                                                               \
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x, stride = (i64)gridDim.x * blockDim.x

// Whether rows of `stride` elements of T starting at `base` are all 16-byte aligned.
template <typename T>
__device__ bool rows_aligned(const T* base, i64 stride) {
    return aligned16(base) && (stride * (i64)sizeof(T)) % 16 == 0;
}

// ---- block reductions (blockDim.x == ROW_THREADS, a power of two) -------------------------

// Sum of `v` over the block in a fixed tree; every thread gets the result. `sh` has
// ROW_THREADS doubles.
__device__ double block_sum_d(double v, double* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] += sh[t + s];
        __syncthreads();
    }
    double r = sh[0];
    __syncthreads();
    return r;
}

// Maximum of `v` over the block (exact, so any order gives the same result).
__device__ float block_max_f(float v, float* sh) {
    int t = threadIdx.x;
    sh[t] = v;
    __syncthreads();
    for (int s = ROW_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sh[t] = fmaxf(sh[t], sh[t + s]);
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// ---- warp reductions (the "warp-row" kernels: one warp of 32 lanes per row) --------------
//
// A fixed butterfly (xor 16, 8, 4, 2, 1): every lane ends with the same value, and the order
// of additions depends only on the lane count, so results are deterministic.

#define WARP 32
#define WARPS_PER_BLOCK (ROW_THREADS / WARP)

__device__ double warp_sum_d(double v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ float warp_max_f(float v) {
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The first row of this warp, the lane, and the row stride of the grid (warp-row kernels).
#define WARP_ROWS(row, rows)                                                                 \
    int lane = threadIdx.x % WARP;                                                           \
    for (i64 row = (i64)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / WARP; row < (rows);     \
         row += (i64)gridDim.x * WARPS_PER_BLOCK)

// ---- a row in a warp's registers (the warp-row layernorm kernels) -------------------------
//
// A lane's whole packs of a row (k = lane, lane + WARP, ... below `packs`), at most R of
// them, loaded by one call: the loads of the row go out together instead of one per step of
// a loop whose next load waits for the sums of the last, and the row is read from memory
// once for all the passes over it. `lane_row_each` visits the elements in for_each_elem's
// order (a lane's packs in order, each pack's elements in order), so a sum over them adds the
// same terms in the same order. Kernels use it where the row's pointers are 16-byte aligned
// (so the row is whole packs, with no tail) and it fits (lane_row_fits), the loops above
// otherwise.

// Packs per lane a warp-row layernorm kernel holds in registers: rows of up to 1024 16-bit
// or 512 f32 elements (GPT-2 124M's 768 in bf16 and fp16: 3 packs per lane).
#define LN_LANE_PACKS 4

template <typename T, int R>
struct LaneRow {
    Pack<T> p[R];
};
// Whether rows of `packs` whole packs fit R packs per lane.
template <int R>
__device__ bool lane_row_fits(i64 packs) {
    return packs <= (i64)R * WARP;
}
template <typename T, int R>
__device__ void lane_row_load(LaneRow<T, R>& r, const T* row, i64 packs, int lane) {
#pragma unroll
    for (int i = 0; i < R; i++) {
        i64 k = lane + (i64)i * WARP;
        if (k < packs) r.p[i] = ld_pack(row + k * PACK(T));
    }
}
// f(c, x) for element c of value x, for each element r holds.
template <typename T, int R, typename F>
__device__ void lane_row_each(const LaneRow<T, R>& r, i64 packs, int lane, F f) {
#pragma unroll
    for (int i = 0; i < R; i++) {
        i64 k = lane + (i64)i * WARP;
        if (k < packs)
#pragma unroll
            for (int j = 0; j < PACK(T); j++) f(k * PACK(T) + j, ld(r.p[i].v[j]));
    }
}

// ---- embedding (ops/encoder.rs) ---------------------------------------------------------

// out (N, C) = wte[tok - vocab_start] (0 outside the shard's `rows` rows) + wpe[i % T].
template <typename T>
__device__ void encoder_forward_k(T* out, const u32* tok, const T* wte, const T* wpe,
                                  int has_wpe, i64 vocab_start, i64 rows, i64 Tn, i64 C,
                                  i64 N) {
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < N * C;
         idx += (i64)gridDim.x * blockDim.x) {
        i64 i = idx / C, c = idx % C;
        i64 r = (i64)tok[i] - vocab_start;
        float v = (r >= 0 && r < rows) ? ld(wte[r * C + c]) : 0.0f;
        if (has_wpe) v += ld(wpe[(i % Tn) * C + c]);
        st(out[idx], v);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void encoder_forward_##S(T* out, const u32* tok, const T* wte,     \
                                                   const T* wpe, int has_wpe,               \
                                                   i64 vocab_start, i64 rows, i64 Tn, i64 C, \
                                                   i64 N) {                                 \
        encoder_forward_k(out, tok, wte, wpe, has_wpe, vocab_start, rows, Tn, C, N);        \
    }
FOR_TYPES(DEF)
#undef DEF

// dwte[row] (float) += dout[p] for the positions p of each row, in increasing p (the host
// buckets the positions by row: rows[u], positions pos[start[u] .. start[u+1]]). One block per
// bucket, threads over C.
template <typename T>
__device__ void encoder_backward_wte_k(float* dwte, const T* dout, const int* rows,
                                       const int* start, const int* pos, int buckets, i64 C) {
    for (int u = blockIdx.x; u < buckets; u += gridDim.x) {
        i64 r = rows[u];
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = dwte[r * C + c];
            for (int k = start[u]; k < start[u + 1]; k++) acc += ld(dout[(i64)pos[k] * C + c]);
            dwte[r * C + c] = acc;
        }
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void encoder_backward_wte_##S(float* dwte, const T* dout,          \
                                                        const int* rows, const int* start,  \
                                                        const int* pos, int buckets, i64 C) { \
        encoder_backward_wte_k(dwte, dout, rows, start, pos, buckets, C);                   \
    }
FOR_TYPES(DEF)
#undef DEF

// dwpe[t] (float) += Σ_b dout[b, t], b in order. One thread per (t, c).
template <typename T>
__device__ void encoder_backward_wpe_k(float* dwpe, const T* dout, i64 B, i64 Tn, i64 C) {
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < Tn * C;
         idx += (i64)gridDim.x * blockDim.x) {
        float acc = dwpe[idx];
        for (i64 b = 0; b < B; b++) acc += ld(dout[b * Tn * C + idx]);
        dwpe[idx] = acc;
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void encoder_backward_wpe_##S(float* dwpe, const T* dout, i64 B,   \
                                                        i64 Tn, i64 C) {                    \
        encoder_backward_wpe_k(dwpe, dout, B, Tn, C);                                       \
    }
FOR_TYPES(DEF)
#undef DEF

// ---- layernorm (ops/layernorm.rs) -------------------------------------------------------

// Mean and rstd of a row from its sum and its sum of squared deviations from the mean, both
// in double (the two passes of the CPU's layernorm_row).
__device__ void ln_forward_stats(float& m, float& rs, double mu, double squares, i64 C) {
    double var = warp_sum_d(squares) / (double)C;
    m = (float)mu;
    rs = (float)(1.0 / sqrt(var + 1e-5));
}
__device__ float ln_forward_elem(float v, float m, float rs, float wc, float bc) {
    return (v - m) * rs * wc + bc;
}

// f(c, x) for each element of row x this lane visits: from the registers xr holds (`cached`)
// or by the packed loop over x, in the same order either way.
template <typename T, int R, typename F>
__device__ void ln_row_each(bool cached, const LaneRow<T, R>& xr, const T* x, i64 C, bool vec,
                            i64 packs, int lane, F f) {
    if (cached)
        lane_row_each(xr, packs, lane, f);
    else
        for_each_elem<T>(C, vec, lane, WARP, f, x);
}

// One warp per row (C is a few hundred to a few thousand: a warp's loads stay coalesced and
// the reductions need no block barrier); mean and variance accumulated in double. Rows of up
// to R packs per lane from registers (LaneRow), wider or unaligned rows by the packed loops
// (read three times, from cache after the first). Both add the same terms in the same order.
template <typename T, int R>
__device__ void layernorm_forward_k(T* out, float* mean, float* rstd, const T* inp,
                                    const T* w, const T* b, i64 N, i64 C) {
    const int P = PACK(T);
    bool vec = rows_aligned(inp, C) && rows_aligned(out, C) && all_aligned16(w, b);
    i64 packs = whole_packs<T>(C, vec);
    bool cached = vec && lane_row_fits<R>(packs);
    WARP_ROWS(row, N) {
        const T* x = inp + row * C;
        T* o = out + row * C;
        LaneRow<T, R> xr;
        if (cached) lane_row_load(xr, x, packs, lane);
        double s = 0.0, ss = 0.0;
        ln_row_each(cached, xr, x, C, vec, packs, lane, [&](i64, float v) { s += (double)v; });
        double mu = warp_sum_d(s) / (double)C;
        ln_row_each(cached, xr, x, C, vec, packs, lane, [&](i64, float v) {
            double d = (double)v - mu;
            ss += d * d;
        });
        float m, rs;
        ln_forward_stats(m, rs, mu, ss, C);
        if (cached) {
#pragma unroll
            for (int i = 0; i < R; i++) {
                i64 k = lane + (i64)i * WARP;
                if (k >= packs) continue;
                Pack<T> wp = ld_pack(w + k * P), bp = ld_pack(b + k * P), op;
#pragma unroll
                for (int j = 0; j < P; j++)
                    st(op.v[j], ln_forward_elem(ld(xr.p[i].v[j]), m, rs, ld(wp.v[j]),
                                                ld(bp.v[j])));
                st_pack(o + k * P, op);
            }
        } else {
            map_elems(o, C, vec, lane, WARP,
                      [&](i64, float v, float wc, float bc) {
                          return ln_forward_elem(v, m, rs, wc, bc);
                      },
                      x, w, b);
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = rs;
        }
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void layernorm_forward_##S(T* out, float* mean, float* rstd,       \
                                                     const T* inp, const T* w, const T* b,  \
                                                     i64 N, i64 C) {                        \
        layernorm_forward_k<T, LN_LANE_PACKS>(out, mean, rstd, inp, w, b, N, C);            \
    }
FOR_TYPES(DEF)
#undef DEF

// dinp += rstd·(g - mean(g) - x̂·mean(g·x̂)) per row, g = dout·w, the row means in double.
// Both backward forms below share these two statements of the arithmetic.
//
// One element's terms of the row sums: g·w and g·w·x̂ (x̂ = (x - mean)·rstd).
struct LnRowSums {
    double s1 = 0.0, s2 = 0.0;
};
__device__ void ln_row_add(LnRowSums& s, float gc, float wc, float xhat) {
    float dn = gc * wc;
    s.s1 += (double)dn;
    s.s2 += (double)(dn * xhat);
}
// One element of dinp from the row means m1 = mean(g·w), m2 = mean(g·w·x̂).
__device__ float ln_dinp(float dc, float gc, float wc, float xhat, float rs, float m1, float m2) {
    return dc + (gc * wc - m1 - xhat * m2) * rs;
}

// The input gradient alone (the weight gradients are column sums, `column_partials`): one
// block per row. The warp-per-row form of the forward kernel measured 3.5x slower here on an
// H100 (GPT-2 124M, C = 768), with 2-byte loads (before the 16-byte packs).
template <typename T>
__device__ void layernorm_backward_dinp_k(T* dinp, const T* dout, const T* inp, const T* w,
                                          const float* mean, const float* rstd, i64 N, i64 C) {
    __shared__ double sh[ROW_THREADS];
    bool vec = rows_aligned(dinp, C) && rows_aligned(dout, C) && rows_aligned(inp, C) &&
               aligned16(w);
    for (i64 row = blockIdx.x; row < N; row += gridDim.x) {
        const T* g = dout + row * C;
        const T* x = inp + row * C;
        float mu = mean[row], rs = rstd[row];
        LnRowSums s;
        for_each_elem<T>(C, vec, threadIdx.x, blockDim.x, [&](i64, float gc, float wc, float xc) {
            ln_row_add(s, gc, wc, (xc - mu) * rs);
        }, g, w, x);
        float m1 = (float)(block_sum_d(s.s1, sh) / (double)C);
        float m2 = (float)(block_sum_d(s.s2, sh) / (double)C);
        T* d = dinp + row * C;
        map_elems(d, C, vec, threadIdx.x, blockDim.x,
                  [&](i64, float dc, float gc, float wc, float xc) {
                      return ln_dinp(dc, gc, wc, (xc - mu) * rs, rs, m1, m2);
                  },
                  d, g, w, x);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void layernorm_backward_dinp_##S(T* dinp, const T* dout,           \
                                                           const T* inp, const T* w,        \
                                                           const float* mean,               \
                                                           const float* rstd, i64 N, i64 C) { \
        layernorm_backward_dinp_k(dinp, dout, inp, w, mean, rstd, N, C);                    \
    }
FOR_TYPES(DEF)
#undef DEF

// The input gradient and the weight gradients' stage-1 column sums in one pass over dout and
// inp (FUGU_LAYERNORM_BACKWARD=fused; the split form reads both again for the column sums).
// A block per chunk k of `rpc` rows, blockDim.x / WARP warps, one warp per row (rows r0 + w,
// r0 + w + warps, ... for warp w). Each warp adds its rows' dout and dout·x̂ into its own 2·C
// floats of dynamic shared memory (each column always by the same lane, so no two lanes touch
// a word); then the block writes part[k, c] = Σ_w (warp w's sum), part2 likewise, and
// `column_finish` adds the chunks as for the split form. Shared words are laid out by
// ln_acc_index so that the 32 lanes touching element j of their packs hit 32 banks.
// Every warp runs the same number of row steps (rows past the chunk are empty), so the
// block's warps reach each shuffle and barrier together. Rows of up to R packs per lane are
// read once, into registers (LaneRow: dout and inp together; w and dinp, pack by pack, as
// they are used), in the packed loops' order of terms; wider or unaligned rows by the loops.
//
// With RMS, the RMS norm's backward (rmsnorm_backward; FUGU_LAYERNORM_BACKWARD picks its form
// too): no mean (x̂ = x·rstd, no mean(g·w) term, as rmsnorm_backward_dinp_k computes dinp), no
// bias, so one column sum per warp ([warps][C] floats), Σ dout·x̂ into `part`.
__device__ i64 ln_acc_index(i64 c, i64 packs, int P) {
    return c < packs * P ? (c % P) * packs + c / P : c;
}
template <typename T, int R, bool RMS = false>
__device__ void layernorm_backward_k(T* dinp, float* part, float* part2, const T* dout,
                                     const T* inp, const T* w, const float* mean,
                                     const float* rstd, i64 N, i64 C, i64 rpc, i64 chunks) {
    DYNAMIC_SHARED(float, acc);  // [warps][SUMS][C]
    constexpr int SUMS = RMS ? 1 : 2;
    const int P = PACK(T);
    int lane = threadIdx.x % WARP, wi = threadIdx.x / WARP, warps = blockDim.x / WARP;
    bool vec = rows_aligned(dinp, C) && rows_aligned(dout, C) && rows_aligned(inp, C) &&
               aligned16(w);
    i64 packs = whole_packs<T>(C, vec);
    bool cached = vec && lane_row_fits<R>(packs);
    float* db = acc + (i64)wi * SUMS * C;
    float* dw = db + (SUMS - 1) * C;
    for (i64 k = blockIdx.x; k < chunks; k += gridDim.x) {
        for (i64 i = threadIdx.x; i < (i64)warps * SUMS * C; i += blockDim.x) acc[i] = 0.0f;
        __syncthreads();
        i64 r0 = k * rpc, r1 = r0 + rpc < N ? r0 + rpc : N;
        i64 steps = (r1 - r0 + warps - 1) / warps;
        for (i64 step = 0; step < steps; step++) {
            i64 row = r0 + step * warps + wi;
            i64 n = row < r1 ? C : 0;  // an empty row past the chunk
            if (!n) row = r0;          // (its pointers stay inside the arrays)
            const T* g = dout + row * C;
            const T* x = inp + row * C;
            T* d = dinp + row * C;
            float mu = RMS ? 0.0f : mean[row], rs = rstd[row];
            LnRowSums s;
            // One element's terms: the row sums and this warp's column sums.
            auto add = [&](i64 c, float gc, float wc, float xc) {
                float xhat = (xc - mu) * rs;
                ln_row_add(s, gc, wc, xhat);
                i64 a = ln_acc_index(c, packs, P);
                if constexpr (!RMS) db[a] += gc;
                dw[a] += gc * xhat;
            };
            if (cached) {
                LaneRow<T, R> gr, xr;
                if (n) {
                    lane_row_load(gr, g, packs, lane);
                    lane_row_load(xr, x, packs, lane);
                }
#pragma unroll
                for (int i = 0; i < R; i++) {
                    i64 kp = lane + (i64)i * WARP;
                    if (!n || kp >= packs) continue;
                    Pack<T> wp = ld_pack(w + kp * P);
#pragma unroll
                    for (int j = 0; j < P; j++)
                        add(kp * P + j, ld(gr.p[i].v[j]), ld(wp.v[j]), ld(xr.p[i].v[j]));
                }
                float m1 = RMS ? 0.0f : (float)(warp_sum_d(s.s1) / (double)C);
                float m2 = (float)(warp_sum_d(s.s2) / (double)C);
#pragma unroll
                for (int i = 0; i < R; i++) {
                    i64 kp = lane + (i64)i * WARP;
                    if (!n || kp >= packs) continue;
                    Pack<T> dp = ld_pack(d + kp * P), wp = ld_pack(w + kp * P);
#pragma unroll
                    for (int j = 0; j < P; j++) {
                        float xhat = (ld(xr.p[i].v[j]) - mu) * rs;
                        st(dp.v[j], ln_dinp(ld(dp.v[j]), ld(gr.p[i].v[j]), ld(wp.v[j]), xhat,
                                            rs, m1, m2));
                    }
                    st_pack(d + kp * P, dp);
                }
                continue;
            }
            for_each_elem<T>(n, vec, lane, WARP, add, g, w, x);
            float m1 = RMS ? 0.0f : (float)(warp_sum_d(s.s1) / (double)C);
            float m2 = (float)(warp_sum_d(s.s2) / (double)C);
            map_elems(d, n, vec, lane, WARP,
                      [&](i64, float dc, float gc, float wc, float xc) {
                          return ln_dinp(dc, gc, wc, (xc - mu) * rs, rs, m1, m2);
                      },
                      d, g, w, x);
        }
        __syncthreads();
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            i64 a = ln_acc_index(c, packs, P);
            float sb = 0.0f, sw = 0.0f;
            for (int j = 0; j < warps; j++) {
                if constexpr (!RMS) sb += acc[(i64)j * 2 * C + a];
                sw += acc[(i64)j * SUMS * C + (SUMS - 1) * C + a];
            }
            if constexpr (RMS) {
                part[k * C + c] = sw;
            } else {
                part[k * C + c] = sb;
                part2[k * C + c] = sw;
            }
        }
        __syncthreads();  // acc is zeroed for the next chunk
    }
}
// Blocks of 8 warps per SM the registers leave room for (C = 768: 48 KB of shared memory per
// block, four fit): three for 16-bit rows (at most 85 registers; ptxas took 86 unbounded,
// which fits two, and spills 8 bytes under the bound), two for f32 (it takes 120).
#define LN_BACKWARD_MIN_BLOCKS(T) (sizeof(T) == 2 ? 3 : 2)
#define DEF(S, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(ROW_THREADS, LN_BACKWARD_MIN_BLOCKS(T))     \
        layernorm_backward_##S(                                                              \
        T* dinp, float* part, float* part2, const T* dout, const T* inp, const T* w,        \
        const float* mean, const float* rstd, i64 N, i64 C, i64 rpc, i64 chunks) {          \
        layernorm_backward_k<T, LN_LANE_PACKS>(dinp, part, part2, dout, inp, w, mean, rstd, N, \
                                               C, rpc, chunks);                             \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(ROW_THREADS, LN_BACKWARD_MIN_BLOCKS(T))     \
        rmsnorm_backward_##S(T* dinp, const T* dout, const T* inp, const T* w,               \
                             const float* rstd, i64 N, i64 C, float* part, i64 rpc,          \
                             i64 chunks) {                                                   \
        layernorm_backward_k<T, LN_LANE_PACKS, true>(dinp, part, nullptr, dout, inp, w,      \
                                                     nullptr, rstd, N, C, rpc, chunks);      \
    }
FOR_TYPES(DEF)
#undef DEF

// Column sums in two fixed stages (bias and layernorm weight gradients; docs/TRAINING.md).
//
// Stage 1: part[k, c] (float) = Σ dout[r, c] over the rows r of chunk k (rows k·rpc ..), in
// row order; with `with_xhat` (layernorm) also part2[k, c] = Σ dout·x̂. One thread per (chunk,
// group of columns): a 16-byte pack of columns where the rows of dout (and inp) are 16-byte
// aligned, so a warp reads 512 contiguous bytes of a row per load; one column otherwise. Each
// column's sum is the same whatever the grouping. T is the type of dout and inp. With RMS (the
// RMS norm's weight gradient, rmsnorm_dw_partials_k) only Σ dout·x̂, x̂ = x·rstd, into part.
template <int W, bool RMS = false, typename T>
__device__ void column_group(float* part, float* part2, const T* dout, const T* inp,
                             const float* mean, const float* rstd, bool with_xhat, i64 r0,
                             i64 r1, i64 C, i64 c0, i64 at) {
    float s[W], s2[W];
    for (int j = 0; j < W; j++) s[j] = s2[j] = 0.0f;
    for (i64 r = r0; r < r1; r++) {
        Pack<T> g, x;  // the first W elements used
        if constexpr (W == PACK(T)) {
            g = ld_pack(dout + r * C + c0);
            if (with_xhat) x = ld_pack(inp + r * C + c0);
        } else {
            for (int j = 0; j < W; j++) {
                g.v[j] = dout[r * C + c0 + j];
                if (with_xhat) x.v[j] = inp[r * C + c0 + j];
            }
        }
        float m = with_xhat && !RMS ? mean[r] : 0.0f, rs = with_xhat ? rstd[r] : 0.0f;
        for (int j = 0; j < W; j++) {
            float gj = ld(g.v[j]);
            if constexpr (RMS) {
                s[j] += gj * (ld(x.v[j]) * rs);
            } else {
                s[j] += gj;
                if (with_xhat) s2[j] += gj * ((ld(x.v[j]) - m) * rs);
            }
        }
    }
    for (int j = 0; j < W; j++) {
        part[at + j] = s[j];
        if (!RMS && with_xhat) part2[at + j] = s2[j];
    }
}
template <typename T>
__device__ void column_partials_k(float* part, float* part2, const T* dout, const T* inp,
                                  const float* mean, const float* rstd, int with_xhat, i64 N,
                                  i64 C, i64 rpc, i64 chunks) {
    // Aligned rows hold whole packs (C·sizeof(T) is a multiple of 16).
    bool vec = rows_aligned(dout, C) && (!with_xhat || rows_aligned(inp, C));
    i64 width = vec ? PACK(T) : 1, groups = C / width;
    GRID_STRIDE(t, stride);
    for (i64 idx = t; idx < chunks * groups; idx += stride) {
        i64 k = idx / groups, c0 = (idx % groups) * width;
        i64 r0 = k * rpc, r1 = r0 + rpc < N ? r0 + rpc : N;
        if (vec)
            column_group<PACK(T)>(part, part2, dout, inp, mean, rstd, with_xhat, r0, r1, C, c0,
                                  k * C + c0);
        else
            column_group<1>(part, part2, dout, inp, mean, rstd, with_xhat, r0, r1, C, c0,
                            k * C + c0);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void column_partials_##S(float* part, float* part2, const T* dout, \
                                                   const T* inp, const float* mean,         \
                                                   const float* rstd, int with_xhat, i64 N, \
                                                   i64 C, i64 rpc, i64 chunks) {            \
        column_partials_k(part, part2, dout, inp, mean, rstd, with_xhat, N, C, rpc, chunks); \
    }
FOR_TYPES(DEF)
#undef DEF

// Stage 2: dst[c] += Σ_k part[k, c], and with dst2 (not null) dst2[c] += Σ_k part2[k, c] in
// the same launch (the layernorm's two weight gradients). A block (ROW_THREADS) per WARP
// columns of one sum, a row launch over the column groups of both: lane l takes column
// c0 + l, warp w the chunks k ≡ w (mod warps), in order (each load a contiguous 128 bytes);
// then the warps' sums are added in warp order. The loads go out FINISH_BATCH at a time ahead
// of the additions (the launch is a few dozen blocks, so it is bound by how many L2 reads each
// warp has in flight); the additions keep their order. T is dst's (and dst2's) type.
#define FINISH_BATCH 16
template <typename T>
__device__ void column_finish_k(T* dst, T* dst2, const float* part, const float* part2, i64 C,
                                i64 chunks) {
    __shared__ float sh[ROW_THREADS];
    int lane = threadIdx.x % WARP, w = threadIdx.x / WARP;
    i64 groups = (C + WARP - 1) / WARP, all = dst2 ? 2 * groups : groups;
    for (i64 gi = blockIdx.x; gi < all; gi += gridDim.x) {
        bool second = gi >= groups;
        T* d = second ? dst2 : dst;
        const float* pt = second ? part2 : part;
        i64 c = (second ? gi - groups : gi) * WARP + lane;
        float s = 0.0f;
        if (c < C)
            for (i64 k0 = w; k0 < chunks; k0 += FINISH_BATCH * WARPS_PER_BLOCK) {
                float v[FINISH_BATCH];
#pragma unroll
                for (int j = 0; j < FINISH_BATCH; j++) {
                    i64 k = k0 + j * WARPS_PER_BLOCK;
                    v[j] = k < chunks ? pt[k * C + c] : 0.0f;
                }
#pragma unroll
                for (int j = 0; j < FINISH_BATCH; j++)
                    if (k0 + j * WARPS_PER_BLOCK < chunks) s += v[j];
            }
        sh[threadIdx.x] = s;
        __syncthreads();
        if (w == 0 && c < C) {
            float total = sh[lane];
            for (int j = 1; j < WARPS_PER_BLOCK; j++) total += sh[j * WARP + lane];
            st(d[c], ld(d[c]) + total);
        }
        __syncthreads();  // sh is reused by the next column group
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void column_finish_##S(T* dst, T* dst2, const float* part,         \
                                                 const float* part2, i64 C, i64 chunks) {   \
        column_finish_k(dst, dst2, part, part2, C, chunks);                                 \
    }
FOR_TYPES(DEF)
#undef DEF

// out[i, j] = bias[j] (the GEMM then adds with beta = 1), for a bias the GEMM's epilogue
// cannot take (not 16-byte aligned; CudaBackend::linear_forward).
template <typename T>
__device__ void broadcast_rows_k(T* out, const T* bias, i64 N, i64 C) {
    GRID_STRIDE(t, stride);
    for (i64 idx = t; idx < N * C; idx += stride) out[idx] = bias[idx % C];
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void broadcast_rows_##S(T* out, const T* bias, i64 N, i64 C) {     \
        broadcast_rows_k(out, bias, N, C);                                                  \
    }
FOR_TYPES(DEF)
#undef DEF

// ---- attention (ops/attention.rs) -------------------------------------------------------

// Causal softmax in place on rows of T; row r is query i = r % T: columns 0..=i become the
// softmax (max-subtracted, sum of exponentials in double), columns i+1 .. the end of the causal
// block of `blk` rows that holds i exactly 0 (the blocked GEMMs read no further; blk = T zeroes
// the whole rest of the row). One warp per row: only columns 0..=i are read (the second and
// third reads hit the cache).
template <typename T>
__device__ void attention_softmax_k(T* att, i64 rows, i64 Tn, i64 blk) {
    WARP_ROWS(r, rows) {
        T* a = att + r * Tn;
        i64 i = r % Tn;
        float mx = NEG_INF;
        for (i64 j = lane; j <= i; j += WARP) mx = fmaxf(mx, ld(a[j]));
        mx = warp_max_f(mx);
        double s = 0.0;
        for (i64 j = lane; j <= i; j += WARP) s += (double)expf(ld(a[j]) - mx);
        float scale = (float)(1.0 / warp_sum_d(s));
        i64 end = (i / blk + 1) * blk < Tn ? (i / blk + 1) * blk : Tn;
        for (i64 j = lane; j < end; j += WARP)
            st(a[j], j <= i ? expf(ld(a[j]) - mx) * scale : 0.0f);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void attention_softmax_##S(T* att, i64 rows, i64 Tn, i64 blk) {    \
        attention_softmax_k(att, rows, Tn, blk);                                            \
    }
FOR_TYPES(DEF)
#undef DEF

// datt = att·(datt - Σ_{k≤i} datt·att) on columns ≤ i, 0 above up to the end of the causal
// block (as in the forward); in place, one warp per row.
template <typename T>
__device__ void attention_softmax_backward_k(T* datt, const T* att, i64 rows, i64 Tn,
                                             i64 blk) {
    WARP_ROWS(r, rows) {
        T* d = datt + r * Tn;
        const T* a = att + r * Tn;
        i64 i = r % Tn;
        double s = 0.0;
        for (i64 j = lane; j <= i; j += WARP) s += (double)(ld(d[j]) * ld(a[j]));
        float sf = (float)warp_sum_d(s);
        i64 end = (i / blk + 1) * blk < Tn ? (i / blk + 1) * blk : Tn;
        for (i64 j = lane; j < end; j += WARP)
            st(d[j], j <= i ? ld(a[j]) * (ld(d[j]) - sf) : 0.0f);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void attention_softmax_backward_##S(T* datt, const T* att,         \
                                                              i64 rows, i64 Tn, i64 blk) {  \
        attention_softmax_backward_k(datt, att, rows, Tn, blk);                             \
    }
FOR_TYPES(DEF)
#undef DEF

// One new token over the cache: block h computes head h. Scores go to dynamic shared memory
// (len floats), then softmax, then each thread one output element of the head.
template <typename T>
__device__ void attention_decode_k(T* out, const T* q, const T* kc, const T* vc, i64 len,
                                   i64 nh, i64 kv, i64 hs, float scale) {
    DYNAMIC_SHARED(float, w);
    __shared__ double sh[ROW_THREADS];
    __shared__ float shf[ROW_THREADS];
    // Cache rows are kv·hs wide; query head h reads key/value head h / (nh / kv).
    i64 ckv = kv * hs;
    for (i64 h = blockIdx.x; h < nh; h += gridDim.x) {
        const T* qh = q + h * hs;
        i64 kh = h / (nh / kv);
        float mx = NEG_INF;
        for (i64 s = threadIdx.x; s < len; s += blockDim.x) {
            const T* k = kc + s * ckv + kh * hs;
            float acc = 0.0f;
            for (i64 d = 0; d < hs; d++) acc += ld(qh[d]) * ld(k[d]);
            w[s] = acc * scale;
            mx = fmaxf(mx, w[s]);
        }
        mx = block_max_f(mx, shf);
        double sum = 0.0;
        for (i64 s = threadIdx.x; s < len; s += blockDim.x) sum += (double)expf(w[s] - mx);
        float inv = (float)(1.0 / block_sum_d(sum, sh));
        for (i64 s = threadIdx.x; s < len; s += blockDim.x) w[s] = expf(w[s] - mx) * inv;
        __syncthreads();
        for (i64 d = threadIdx.x; d < hs; d += blockDim.x) {
            float acc = 0.0f;
            for (i64 s = 0; s < len; s++) acc += w[s] * ld(vc[s * ckv + kh * hs + d]);
            st(out[h * hs + d], acc);
        }
        __syncthreads();
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void attention_decode_##S(T* out, const T* q, const T* kc,         \
                                                    const T* vc, i64 len, i64 nh, i64 kv,   \
                                                    i64 hs, float scale) {                  \
        attention_decode_k(out, q, kc, vc, len, nh, kv, hs, scale);                         \
    }
FOR_TYPES(DEF)
#undef DEF

// A rotary embedding's rotation of the pair (x0, x1) (ops/rope.rs; rope_k below). The products
// are rounded on their own (__fmul_rn: never contracted into an fma), as the CPU
// computes them, so that the attention backward's stores (fa_store with FaRope) rotate to the
// same bits as this kernel.
__device__ void rope_pair(float& x0, float& x1, float c, float sn) {
    float r0 = __fmul_rn(x0, c) - __fmul_rn(x1, sn), r1 = __fmul_rn(x1, c) + __fmul_rn(x0, sn);
    x0 = r0;
    x1 = r1;
}

// ---- fused (flash) attention (ops/attention.rs, attention_forward_fused / _backward_fused) ---
//
// FlashAttention-2 on the tensor cores, for the 16-bit storage types only (FOR_HALF_TYPES; the
// host never selects it for f32, or on a GPU older than sm_80): the (T, T) probabilities are
// never stored. A block of FA_THREADS threads (4 warps) owns 64 query rows (forward, dQ) or 64
// keys (dK, dV) of one (sequence, head); each warp 16 of them. Tiles of 64 rows × hs go
// through shared memory row-major, zero-padded to D columns (D = 64 for heads of at most 64,
// the _d128 kernels D = 128 for heads of 65 to 128; row stride FA_LDS(D) = D + 8 elements:
// 16-byte rows land in different banks). Products are mma.m16n8k16 (16-bit operands,
// f32 accumulation). The accumulator layout of S = Q·Kᵀ is the A-operand layout of P·V, so
// probabilities go from registers to the next product without shared memory; operands needed
// transposed (V in P·V, K in dS·K, Q and dO in the dK/dV products) are read with
// ldmatrix.trans. P and dS are rounded to T for their products (as the materialized path
// stores them). Softmax statistics are f32; exponentials are exp2 of log2-scaled scores
// (ex2.approx: relative error ~2^-22, far below the 16-bit rounding that follows). Masks apply
// on the diagonal tile only.
//
// Backward: deterministic, as the rest of this file. By default one kernel computes dQ (and
// Δ = rowsum(dO ∘ O)) per query block, looping over keys; a second computes dK and dV per key
// block, looping over queries. S and dP are computed in both: seven 64×64×hs products per tile
// pair instead of FlashAttention-2's five, which adds dQ's shares with floating-point atomics
// (an order that changes from run to run). FUGU_FLASH_BACKWARD=fused runs five: the dK/dV
// kernel also multiplies each tile's dS by K and adds the shares of a query block's dQ in turn,
// key block 0 first (flash_backward_dkv_k with DS_TURNS, after flash_backward_prep computes Δ).
// FUGU_FLASH_BACKWARD=stored runs five too: the dK/dV kernel stores each tile's dS (DS_STORE),
// and flash_backward_dq_stored multiplies it by K, key blocks in order: the same bits as the
// default, for a write and a read of dS (T² bytes per (sequence, head) in 16 bits).
// Every warp of a block runs the same loop (masking is done on values), which the host
// emulator's warp-collective mma and ldmatrix need.

#define FA_ROWS 64
// The head width of the warpgroup-MMA kernels' tiles (and of the 64 × 64 probe).
#define FA_WG_D 64
// Row stride, in elements, of a shared-memory tile of width D.
#define FA_LDS(D) ((D) + 8)
// The widest tiles a kernel keeps in static shared memory (fa_tiles); wider ones (the _d128
// kernels') go to dynamic shared memory, and their backward kernels reread (FA_REREAD).
#define FA_STATIC_D 64
#define FA_THREADS 128
#define POS_INF __int_as_float(0x7f800000)
#define LOG2E 1.4426950408889634f
#define FOR_HALF_TYPES(X) X(bf16, bf16) X(f16, f16)
// Blocks per SM each kernel is compiled for (registers capped at 65536 / (128 · n)): measured
// on an H200 (GPT-2 124M, B=16, T=1024, bf16), 4 / 4 / 3 gave the fastest step (50.3 ms
// against 51.8 uncapped: the forward kernel 2.64 → 2.13 ms, the backward 8.15 → 7.00 ms).
#define FA_MINB_FWD 4
// The forward kernel with 32 query rows per warp (flash_forward_wide, 64 threads; opt-in,
// 2.26 ms per GPT-2 124M step against 2.03 for flash_forward on an H200): ptxas (CUDA 13.5,
// sm_90) gives it 246 registers and no spills at 4 blocks of 2 warps per SM (8 warps,
// FlashAttention-2's occupancy); capped for 6 blocks it spills 148 bytes, for 8 (the same
// 128-register cap as flash_forward) 736.
#define FA_MINB_FWD_WIDE 4
#define FA_MINB_DQ 4
#define FA_MINB_DKV 3
// The backward kernels with 32 rows per warp (opt-in; with all three wide, 1.8% slower per
// GPT-2 124M step on an H200, docs/TRAINING.md): at 4 blocks of 2 warps, ptxas gives both the
// 255-register maximum; they read their own tiles' fragments (Q and dO, K and
// V) from dynamic shared memory on every loop step (the host's FLASH_KV_SHMEM: 56 KB per block
// in all, 4 blocks in an H100's 228 KB) and spill 12 and 40 bytes, where holding them in
// registers spilled 96 and about 400 (the 16-row kernels spill 76 and 32 at their caps).
#define FA_MINB_DQ_WIDE 4
#define FA_MINB_DKV_WIDE 4
// The dK/dV kernel on warpgroup MMA (FUGU_FLASH_MMA=wgmma): at 3 blocks per SM (the others'
// 168-register cap) ptxas (CUDA 13.5) serializes its wgmma instructions for want of registers;
// at 2 it does not. Not yet measured on a GPU.
#define FA_MINB_DKV_WG 2
// The dQ kernel from stored dS (FUGU_FLASH_BACKWARD=stored): two products' operands per tile
// (K, dS) and one accumulator, 37 KB of static shared memory; 5 blocks per SM fit an H100's
// 228 KB (ptxas, CUDA 13.5, sm_90: 96 registers, 162 with 32 rows per warp, no spills; not
// yet measured on a GPU).
#define FA_MINB_DQ_STORED 5
// The one-kernel backward (FUGU_FLASH_BACKWARD=fused; measured 14.2 ms per GPT-2 124M step on
// an H200 against 6.5 for the two kernels, opt-in): 65 KB of shared memory per
// block (the dK/dV kernel's, plus K, V and dS kept for dQ), so 3 blocks per SM whatever the
// rows per warp.
#define FA_MINB_FUSED 3
// The head-128 kernels (the _d128 forms: every tile in dynamic shared memory, 18 KB each; the
// backward's reread their own tiles' fragments, FA_REREAD): the forward's four tiles (70 KB)
// allow 3 blocks per SM in an H100's 228 KB, the backward's six (104 KB) 2.
#define FA_MINB_FWD_D128 2
// The head-128 forward on warpgroup MMA with 128 query rows per block (two warpgroups on the
// same K and V tiles, FlashAttention-3's block for heads of 128): at about 190 registers, one
// block of 8 warps per SM (two would cap them at 128 and spill).
#define FA_MINB_FWD_D128_Q128 1
// The overlapped wgmma forward (FUGU_FLASH_OVERLAP=on) keeps a second P and the scores of the
// next block live beside the product in flight: compiled for 4 blocks per SM as the others,
// until ptxas says otherwise (scripts/ptxas-report.sh).
#define FA_MINB_FWD_OVL 4
#define FA_MINB_DQ_D128 2
#define FA_MINB_DKV_D128 2
// The dQ kernel from stored dS for heads of 128: four tiles (70 KB), 3 blocks per SM.
#define FA_MINB_DQ_STORED_D128 3

#ifdef __CUDACC_RTC__
template <typename T>
__device__ u32 ld32(const T* p) {
    return *reinterpret_cast<const u32*>(p);
}
template <typename T>
__device__ void st32(T* p, u32 w) {
    *reinterpret_cast<u32*>(p) = w;
}
// Waits (thread 0 of a block) until `*turn` is `want`, then orders this block's later reads
// after the writes of the block that passed the turn (fa_add_dq_share). The block owning the
// turn took its work item earlier (fa_next_item), so it is running: the wait ends within a
// few tiles' time. Past 2^31 cycles (about a second; a bug) the kernel traps: an error, not a
// hang.
__device__ void fa_wait_turn(const int* turn, int want) {
    long long start = clock64();
    while (*(const volatile int*)turn != want) {
#if __CUDA_ARCH__ >= 700
        __nanosleep(64);
#endif
        if (clock64() - start > (1LL << 31)) __trap();
    }
    __threadfence();
}
__device__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// c (16×8, f32) += a (16×16) · b (16×8), the PTX fragment layouts: lane = 4·g + t holds
// a{0,1,2,3} = A[g][2t..], A[g+8][2t..], A[g][2t+8..], A[g+8][2t+8..]; b{0,1} = B[2t..][g],
// B[2t+8..][g]; c{0,1,2,3} = C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1] (pairs: low half
// first).
// Below sm_80 the instruction does not exist: the host never launches these kernels there
// (CudaBackend::fused_attention), and the body traps.
#if __CUDA_ARCH__ >= 800
#define MMA16816(T, PTX)                                                                     \
    __device__ void mma16816(float* c, const u32* a, const u32* b, T) {                      \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX                    \
                     ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"            \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                        \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));    \
    }
#else
#define MMA16816(T, PTX) \
    __device__ void mma16816(float*, const u32*, const u32*, T) { __trap(); }
#endif
MMA16816(bf16, "bf16")
MMA16816(f16, "f16")
#undef MMA16816
// A shared-memory address (a byte offset into the block's shared window), computed once per
// tile; ldmatrix and cp.async take it with constant byte offsets added.
typedef u32 smem_t;
template <typename T>
__device__ smem_t smem(T* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (smem_t)a;
}
// 16 bytes from global to shared memory without passing through registers (zeros when
// `valid` is false; `src` must then still be a mapped address), in the current group.
__device__ void cp_async16(smem_t dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
#else
    __trap();
#endif
}
// Closes the current group of copies; waits until at most one group is still in flight.
__device__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
__device__ void cp_async_wait_prior() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;");
#endif
}
// Waits for every copy issued so far (committed or not).
__device__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;");
#endif
}
// Four 8×8 matrices of 16-bit elements from shared memory: lane 8j + i gives the address of
// row i of matrix j; lane 4g + t receives r[j] = {M_j[g][2t], M_j[g][2t+1]} (the B-operand
// layout of an n × k tile stored row-major, i.e. of Bᵀ).
// ldsm_x4_trans, the same transposed: lane 4g + t receives r[j] = {M_j[2t][g], M_j[2t+1][g]}
// (the B-operand layout of a k × n tile stored row-major).
#define LDSM_X4(NAME, PTX)                                                                   \
    __device__ void NAME(u32* r, smem_t a) {                                                 \
        asm volatile("ldmatrix.sync.aligned.m8n8.x4" PTX ".shared.b16 {%0,%1,%2,%3}, [%4];"  \
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                        \
                     : "r"(a));                                                              \
    }
LDSM_X4(ldsm_x4, "")
LDSM_X4(ldsm_x4_trans, ".trans")
#undef LDSM_X4
#else
// The host emulator: the same fragment layouts, products of the widened values summed in f32
// in k order (a GPU's summation order inside the instruction is unspecified).
template <typename T>
__device__ u32 ld32(const T* p) {
    u32 w;
    memcpy(&w, p, sizeof w);
    return w;
}
template <typename T>
__device__ void st32(T* p, u32 w) {
    memcpy(p, &w, sizeof w);
}
// Blocks run in order here, each item of the one-kernel backward after the items it waits for:
// a turn not yet come is a bug.
__device__ void fa_wait_turn(const int* turn, int want) {
    if (*turn != want) {
        fprintf(stderr, "fa_wait_turn: turn %d, waiting for %d (a block waits for a later one)\n",
                *turn, want);
        abort();
    }
}
__device__ float fast_exp2(float x) { return exp2f(x); }
typedef char* smem_t;
template <typename T>
__device__ smem_t smem(T* p) {
    return reinterpret_cast<char*>(p);
}
// Copies land when a wait says they have, as on a GPU, where they run asynchronously: each
// thread queues its copies in the current group, cp_async_commit closes the group, and a wait
// carries out the groups it waits for (all but the newest one, or all) in order. A kernel that
// reads a tile before waiting for its copies, or whose copies overwrite a tile that an
// earlier product still reads (the emulated wgmma reads at its wait), computes something else
// here and fails its tests. Copies a block never waited for are dropped at its end.
struct CpCopy {
    smem_t dst;
    const void* src;
    bool valid;
};
// The calling thread's entry of an emulated per-thread state (its asynchronous copies or
// products in flight), after Q::new_block where the thread's last use was in another block.
template <typename Q>
Q& fugu_thread_state(std::vector<Q>& all) {
    if (all.size() < blockDim.x) all.resize(blockDim.x);
    Q& q = all[threadIdx.x];
    if (q.block != blockIdx.x) {
        q.new_block();
        q.block = blockIdx.x;
    }
    return q;
}
struct CpQueue {
    std::vector<std::vector<CpCopy>> committed;
    std::vector<CpCopy> current;
    unsigned block = 0;
    void new_block() {
        committed.clear();
        current.clear();
    }
};
static std::vector<CpQueue> cp_queues;
static CpQueue& cp_queue() { return fugu_thread_state(cp_queues); }
static void cp_land(const std::vector<CpCopy>& group) {
    for (const CpCopy& c : group) {
        if (c.valid)
            memcpy(c.dst, c.src, 16);
        else
            memset(c.dst, 0, 16);
    }
}
__device__ void cp_async16(smem_t dst, const void* src, bool valid) {
    cp_queue().current.push_back({dst, src, valid});
}
__device__ void cp_async_commit() {
    CpQueue& q = cp_queue();
    q.committed.push_back(std::move(q.current));
    q.current.clear();
}
__device__ void cp_async_wait_prior() {
    CpQueue& q = cp_queue();
    while (q.committed.size() > 1) {
        cp_land(q.committed.front());
        q.committed.erase(q.committed.begin());
    }
}
__device__ void cp_async_wait_all() {
    CpQueue& q = cp_queue();
    for (const auto& g : q.committed) cp_land(g);
    cp_land(q.current);
    q.committed.clear();
    q.current.clear();
}
template <typename T>
__device__ float half_of(u32 w, int k) {
    T x;
    x.bits = (unsigned short)((k & 1) ? w >> 16 : w & 0xffffu);
    return ld(x);
}
template <typename T>
__device__ void mma16816(float* c, const u32* a, const u32* b, T) {
    u32 mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
    const u32* all = fugu_emu_warp_publish(mine, 6);
    int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    for (int e = 0; e < 4; e++) {
        int row = g + (e >> 1) * 8, col = 2 * t + (e & 1);
        float acc = 0.0f;
        for (int k = 0; k < 16; k++) {
            int la = (row & 7) * 4 + ((k & 7) >> 1), ra = (row >> 3) + 2 * (k >> 3);
            int lb = col * 4 + ((k & 7) >> 1), rb = k >> 3;
            acc += half_of<T>(all[la * FUGU_EMU_WARP_WORDS + ra], k) *
                   half_of<T>(all[lb * FUGU_EMU_WARP_WORDS + 4 + rb], k);
        }
        c[e] += acc;
    }
    fugu_emu_warp_release();
}
// ldmatrix: every lane publishes its row address; lane 4g + t then reads, per matrix j, two
// 16-bit elements: row g at columns 2t, 2t+1, or (transposed) rows 2t, 2t+1 at column g.
__device__ void ldsm_emulated(u32* r, smem_t a, bool trans) {
    u32 mine[2];
    memcpy(mine, &a, sizeof a);
    const u32* all = fugu_emu_warp_publish(mine, 2);
    int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; j++) {
        for (int h = 0; h < 2; h++) {
            int row = trans ? 2 * t + h : g, col = trans ? g : 2 * t + h;
            smem_t p;
            memcpy(&p, &all[(8 * j + row) * FUGU_EMU_WARP_WORDS], sizeof p);
            unsigned short v;
            memcpy(&v, p + 2 * col, sizeof v);
            if (h == 0)
                r[j] = v;
            else
                r[j] |= (u32)v << 16;
        }
    }
    fugu_emu_warp_release();
}
__device__ void ldsm_x4(u32* r, smem_t a) { ldsm_emulated(r, a, false); }
__device__ void ldsm_x4_trans(u32* r, smem_t a) { ldsm_emulated(r, a, true); }
#endif

// Two values rounded to T, packed low first (an mma operand register). On the GPU one
// cvt.rn (round to nearest even, as st) converts both.
#if defined(__CUDACC_RTC__) && __CUDA_ARCH__ >= 800
template <typename T>
__device__ u32 pack2(float lo, float hi);
#define PACK2(T, PTX)                                                                        \
    template <>                                                                              \
    __device__ u32 pack2<T>(float lo, float hi) {                                            \
        u32 r;                                                                               \
        asm("cvt.rn." PTX "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                \
        return r;                                                                            \
    }
PACK2(bf16, "bf16")
PACK2(f16, "f16")
#undef PACK2
#else
template <typename T>
__device__ u32 pack2(float lo, float hi) {
    T a, b;
    st(a, lo);
    st(b, hi);
    return (u32)a.bits | ((u32)b.bits << 16);
}
#endif

// ---- warpgroup MMA (wgmma, sm_90a: FUGU_FLASH_MMA=wgmma) ----------------------------
//
// A warpgroup (4 warps) multiplies A (64 × 16, from registers: warp w its rows 16w.., in
// mma.m16n8k16's A layout) by B (16 × 64) that the tensor cores read from shared memory
// themselves, into D (64 × 64 f32: warp w its rows 16w.., per 8 columns in mma's C layout, so
// the fa_* helpers' accumulator code serves both). B comes from a 64 × 64 tile of 16-bit
// elements, rows of 128 bytes in the 128-byte swizzle (the 16-byte chunk c of row r stored at
// chunk c ^ (r % 8); tiles 1024-byte aligned, fa_sw): a K tile (keys × head dimensions) is B
// K-major for S = Q·Kᵀ, the k16 slice kd starting 32·kd bytes in; a V tile (keys × head
// dimensions) is B N-major (wgmma's transposed B) for O += P·V, the slice of keys 16·kk..
// starting 2048·kk bytes in. The shared-memory descriptor: start address / 16 (bits 0-13), the
// leading and stride byte offsets / 16 (bits 16-29, 32-45) both 1024 (a group of 8 rows; a
// 64-column tile has one 128-byte swizzle atom across, so whichever of the two the layout does
// not use is ignored), swizzle mode 1, 128 bytes (bits 62-63). Tiles written by the threads
// (cp.async or stores) are fenced to the tensor cores' asynchronous reads (fence.proxy.async)
// before the barrier that precedes the products.
typedef unsigned long long u64;

// Element (r, c) of a 64 × 64 tile in the 128-byte swizzle.
__device__ int fa_sw(int r, int c) { return r * FA_WG_D + ((((c >> 3) ^ r) & 7) << 3) + (c & 7); }
// Element (r, c) of a 64 × D swizzled tile: D / 64 such 64 × 64 tiles one after another (8 KB
// apart, so each 1024-byte aligned), columns 64·j .. in the j-th (the _d128 wgmma kernels).
template <int D>
__device__ int fa_swd(int r, int c) {
    return (c / FA_WG_D) * (FA_ROWS * FA_WG_D) + fa_sw(r, c % FA_WG_D);
}

#if defined(__CUDACC_RTC__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ u64 wg_desc(smem_t a) {
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)(1024 >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
           (1ull << 62);
}
__device__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits until at most the newest committed group is in flight.
__device__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// Pins n accumulators (rows of 4) in place around a wait: the compiler may move register
// reads and writes across an asm statement that does not name them, so without this it could
// read an accumulator before the wait for its product (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ void wg_fence_acc(float (*acc)[4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
        asm volatile(""
                     : "+f"(acc[n][0]), "+f"(acc[n][1]), "+f"(acc[n][2]), "+f"(acc[n][3])
                     :
                     : "memory");
}
// The same for n A fragments (rows of 4 registers): they stay the fragments' registers until
// the wait, so that no value computed meanwhile is given them while a product still reads them.
template <int N>
__device__ void wg_fence_frags(u32 (*a)[4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
        asm volatile("" : "+r"(a[n][0]), "+r"(a[n][1]), "+r"(a[n][2]), "+r"(a[n][3]) : : "memory");
}
__device__ void wg_fence_tiles() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#define WG_D8(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
// d (64 × 64 of the warpgroup) = A · B, or with `acc` d + A · B.
#define WGMMA(T, PTX)                                                                        \
    template <int TRANS_B>                                                                   \
    __device__ void wgmma_64x64x16(float (*d)[4], const u32* a, u64 desc, int acc, T) {      \
        asm volatile(                                                                        \
            "{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                     \
            "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " "                    \
            "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "        \
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "    \
            "%31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"                            \
            : WG_D8(0), WG_D8(1), WG_D8(2), WG_D8(3), WG_D8(4), WG_D8(5), WG_D8(6), WG_D8(7) \
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TRANS_B),           \
              "r"(acc));                                                                     \
    }
WGMMA(bf16, "bf16")
WGMMA(f16, "f16")
#undef WGMMA
#undef WG_D8
#elif defined(__CUDACC_RTC__)
// Below sm_90a the instruction does not exist: the host never launches the wgmma kernels there
// (Engine::wgmma), and the bodies trap.
__device__ u64 wg_desc(smem_t) { return 0; }
__device__ void wg_fence() {}
__device__ void wg_commit() {}
__device__ void wg_wait() {}
__device__ void wg_wait1() {}
template <int N>
__device__ void wg_fence_acc(float (*)[4]) {}
template <int N>
__device__ void wg_fence_frags(u32 (*)[4]) {}
__device__ void wg_fence_tiles() {}
template <int TRANS_B, typename T>
__device__ void wgmma_64x64x16(float (*)[4], const u32*, u64, int, T) {
    __trap();
}
#else
// The host emulator: the descriptor is the tile's host address (the layout constants are the
// ones above); the products of the widened values summed in f32 in k order per 16-deep slice,
// as the emulated mma16816 sums them (a GPU's order inside the instruction is unspecified).
//
// As on a GPU, where wgmma.mma_async runs asynchronously, a product takes effect at the wait
// for its group, not at its issue: wgmma_64x64x16 queues the thread's product (the addresses
// of its accumulators and A fragments, the descriptor), wg_commit closes a group, and wg_wait
// computes the committed products in issue order, reading the A fragments and the tile then
// and writing the accumulators then. A kernel that reads or writes an accumulator or an A
// fragment, or overwrites a tile, between a product's issue and the wait for its group
// (undefined on a GPU) computes something else here and fails its tests; a wait with products
// not committed, or a block that ends with products never waited for, stops the emulator.
__device__ u64 wg_desc(smem_t a) { return (u64)(uintptr_t)a; }
__device__ void wg_fence() {}
__device__ void wg_fence_tiles() {}
// Byte address of row r, element c of the swizzled tile whose slice starts at `start`: the
// address before the swizzle, then bits 4-6 XOR bits 7-9 (tiles are 1024-byte aligned).
__device__ const char* wg_at(u64 start, int r, int c) {
    uintptr_t a = (uintptr_t)start + (r >> 3) * 1024 + (r & 7) * 128 + (c >> 3) * 16 + (c & 7) * 2;
    return (const char*)(a ^ (((a >> 7) & 7) << 4));
}
// One product of the warpgroup, computed now (every thread of the warpgroup calls it with its
// own accumulators and fragments: the A fragments are gathered across the 128 threads).
template <int TRANS_B, typename T>
void wg_product(float (*d)[4], const u32* a, u64 desc, int acc) {
    u32 mine[4] = {a[0], a[1], a[2], a[3]};
    const u32* all = fugu_emu_lanes_publish(mine, 4, 4 * WARP);
    int warp = (threadIdx.x / WARP) & 3, lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    for (int n = 0; n < 8; n++)
        for (int e = 0; e < 4; e++) {
            int row = 16 * warp + g + (e >> 1) * 8, col = 8 * n + 2 * t + (e & 1);
            float sum = 0.0f;
            for (int k = 0; k < 16; k++) {
                int rr = row & 15, la = 32 * (row >> 4) + 4 * (rr & 7) + ((k & 7) >> 1);
                u32 w = all[la * FUGU_EMU_WARP_WORDS + (rr >> 3) + 2 * (k >> 3)];
                T x, y;
                x.bits = (unsigned short)((k & 1) ? w >> 16 : w & 0xffffu);
                const char* p = TRANS_B ? wg_at(desc, k, col) : wg_at(desc, col, k);
                memcpy(&y.bits, p, 2);
                sum += ld(x) * ld(y);
            }
            d[n][e] = acc ? d[n][e] + sum : sum;
        }
    fugu_emu_warp_release();
}
// A thread's products in flight: the committed groups', in order, and those issued since.
struct WgPending {
    float (*d)[4];
    const u32* a;
    u64 desc;
    int acc;
    void (*run)(float (*)[4], const u32*, u64, int);
};
struct WgQueue {
    std::vector<std::vector<WgPending>> committed;
    std::vector<WgPending> current;
    unsigned block = 0;
    void new_block() {
        if (!committed.empty() || !current.empty()) {
            fprintf(stderr, "emulated wgmma: a block ended with products never waited for\n");
            abort();
        }
    }
};
static std::vector<WgQueue> wg_queues;
static WgQueue& wg_queue() { return fugu_thread_state(wg_queues); }
template <int TRANS_B, typename T>
__device__ void wgmma_64x64x16(float (*d)[4], const u32* a, u64 desc, int acc, T) {
    wg_queue().current.push_back({d, a, desc, acc, &wg_product<TRANS_B, T>});
}
__device__ void wg_commit() {
    WgQueue& q = wg_queue();
    q.committed.push_back(std::move(q.current));
    q.current.clear();
}
// Carries out the committed groups but the newest `left`, in order.
__device__ void wg_wait_left(size_t left) {
    WgQueue& q = wg_queue();
    if (!q.current.empty()) {
        fprintf(stderr, "emulated wgmma: a wait with products not committed to a group\n");
        abort();
    }
    // The groups run are moved out first: each product yields to the other threads.
    size_t n = q.committed.size() > left ? q.committed.size() - left : 0;
    std::vector<std::vector<WgPending>> run(std::make_move_iterator(q.committed.begin()),
                                            std::make_move_iterator(q.committed.begin() + n));
    q.committed.erase(q.committed.begin(), q.committed.begin() + n);
    for (const auto& g : run)
        for (const WgPending& p : g) p.run(p.d, p.a, p.desc, p.acc);
}
__device__ void wg_wait() { wg_wait_left(0); }
__device__ void wg_wait1() { wg_wait_left(1); }
template <int N>
__device__ void wg_fence_acc(float (*)[4]) {}
template <int N>
__device__ void wg_fence_frags(u32 (*)[4]) {}
#endif

// The byte offset of the 64 × 64 swizzled tile j of a D-wide one (fa_swd).
#define FA_WG_TILE_BYTES (FA_ROWS * FA_WG_D * 2)

// acc (this warp's 16 rows of the warpgroup's 64 × 64) = A (fragments over D) · Bᵀ, B the
// swizzled tile `s` (64 rows × D: K), as fa_mma_abt_m computes it: the k16 slice kd from the
// 64-column tile kd / 4, 32 · (kd % 4) bytes in.
// fa_wg_abt_issue only issues the products (after a wg_fence; a wg_commit and wg_wait
// later), so that another chain can follow before the wait.
template <typename T, int D = FA_WG_D>
__device__ void fa_wg_abt_issue(float (*acc)[4], u32 (*a)[4], T* s) {
    smem_t sb = smem(s);
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++)
        wgmma_64x64x16<0>(acc, a[kd], wg_desc(sb + (kd / 4) * FA_WG_TILE_BYTES + 32 * (kd % 4)),
                          kd > 0, T());
}
template <typename T, int D = FA_WG_D>
__device__ void fa_wg_abt(float (*acc)[4], u32 (*a)[4], T* s) {
    wg_fence();
    fa_wg_abt_issue<T, D>(acc, a, s);
    wg_commit();
    wg_wait();
}
// acc += P (this warp's 16 rows × 64 keys, packed A fragments) · B, B the swizzled tile `s`
// (64 keys × D: V), as fa_mma_pb_m computes it: columns 64·j .. of acc (its accumulators
// 8·j ..) from the 64-column tile j.
// (fa_wg_pb_issue: the products only, as fa_wg_abt_issue.)
template <typename T, int D = FA_WG_D>
__device__ void fa_wg_pb_issue(float (*acc)[4], u32 (*pa)[4], T* s) {
    smem_t sb = smem(s);
#pragma unroll
    for (int j = 0; j < D / FA_WG_D; j++)
#pragma unroll
        for (int kk = 0; kk < FA_ROWS / 16; kk++)
            wgmma_64x64x16<1>(acc + j * (FA_WG_D / 8), pa[kk],
                              wg_desc(sb + j * FA_WG_TILE_BYTES + 2048 * kk), 1, T());
}
template <typename T, int D = FA_WG_D>
__device__ void fa_wg_pb(float (*acc)[4], u32 (*pa)[4], T* s) {
    wg_fence();
    fa_wg_pb_issue<T, D>(acc, pa, s);
    wg_commit();
    wg_wait();
}

// Whether a tile's rows can be copied 8 elements (16 bytes) at a time.
template <typename T>
__device__ bool fa_vec_ok(const T* base, i64 hs, i64 ldq) {
    return (hs % 8) == 0 && (ldq % 8) == 0 && ((unsigned long long)base % 16) == 0;
}

// Rows row0 .. row0+64 (columns 0 .. hs) of a row-major matrix with row stride `ldq` into a
// 64 × D tile `s` (row stride FA_LDS(D)), zero beyond row Tn and column hs: with `vec`, as
// asynchronous 16-byte copies in the current group (complete after cp_async_wait_prior of a
// later group, or of this one's successor, and a barrier), else element by element (complete
// after the next barrier).
//
// With SW the tile is laid out for the tensor cores' own reads (wgmma): D / 64 tiles of 64
// columns, rows of 128 bytes, no padding, the 16-byte chunks of row r swizzled (fa_swd).
template <typename T, int D, bool SW = false>
__device__ void fa_load(T* s, const T* src, i64 row0, i64 Tn, i64 ldq, int hs, bool vec) {
    static_assert(!SW || D % FA_WG_D == 0, "the swizzled tiles are 64 columns wide");
    auto at = [](int r, int c) { return SW ? fa_swd<D>(r, c) : r * FA_LDS(D) + c; };
    if (vec) {
        smem_t sb = smem(s);
        for (int i = threadIdx.x; i < FA_ROWS * (D / 8); i += blockDim.x) {
            int r = i / (D / 8), c = (i % (D / 8)) * 8;
            bool valid = row0 + r < Tn && c < hs;
            cp_async16(sb + 2 * at(r, c), valid ? src + (row0 + r) * ldq + c : src, valid);
        }
    } else {
        T z;
        z.bits = 0;
        for (int i = threadIdx.x; i < FA_ROWS * D; i += blockDim.x) {
            int r = i / D, c = i % D;
            s[at(r, c)] = (row0 + r < Tn && c < hs) ? src[(row0 + r) * ldq + c] : z;
        }
    }
}

// The A fragments (16 rows from `row`, the head dimension in chunks of 16) of a tile. Heads
// narrower than the tile's D columns are zero-padded, so every chunk is multiplied.
template <typename T, int D>
__device__ void fa_a_frags(u32 (*a)[4], const T* s, int row) {
    int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kd = 0; kd < D / 16; kd++) {
        const T* p = s + (row + g) * FA_LDS(D) + kd * 16 + 2 * t;
        a[kd][0] = ld32(p);
        a[kd][1] = ld32(p + 8 * FA_LDS(D));
        a[kd][2] = ld32(p + 8);
        a[kd][3] = ld32(p + 8 * FA_LDS(D) + 8);
    }
}

// The A fragments of a warp's M row groups (16 rows each, from `row0`) of a tile.
template <typename T, int M, int D>
__device__ void fa_a_frags_m(u32 (*a)[D / 16][4], const T* s, int row0) {
#pragma unroll
    for (int i = 0; i < M; i++) fa_a_frags<T, D>(a[i], s, row0 + 16 * i);
}

// Stores a warp's M groups of A fragments (16 rows × 64 columns each, from row0; as fa_pack
// leaves them) into tile `s` of row stride LD (a shared-memory tile, or a dS tile in global
// memory): the inverse of fa_a_frags_m.
template <typename T, int M, int LD = FA_LDS(FA_ROWS)>
__device__ void fa_put_frags_m(T* s, u32 (*a)[FA_ROWS / 16][4], int row0) {
    int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int kk = 0; kk < FA_ROWS / 16; kk++) {
            T* p = s + (row0 + 16 * i + g) * LD + kk * 16 + 2 * t;
            st32(p, a[i][kk][0]);
            st32(p + 8 * LD, a[i][kk][1]);
            st32(p + 8, a[i][kk][2]);
            st32(p + 8 * LD + 8, a[i][kk][3]);
        }
}

// The A fragments of the transpose of tile `s` (64 × 64, row stride FA_LDS(64)): rows
// row0.. of sᵀ (columns of s), k along s's rows, in M groups of 16 rows; by ldmatrix.trans,
// matrix j of each x4 the 8 × 8 block at s's rows 16·kk + 8·(j / 2), columns row0 + 8·(j % 2).
template <typename T, int M>
__device__ void fa_a_frags_trans_m(u32 (*a)[FA_ROWS / 16][4], T* s, int row0) {
    constexpr int LD = FA_LDS(FA_ROWS);
    int lane = threadIdx.x % WARP, j = lane >> 3, r = lane & 7;
    smem_t lp = smem(s) + 2 * ((r + 8 * (j >> 1)) * LD + 8 * (j & 1) + row0);
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int kk = 0; kk < FA_ROWS / 16; kk++)
            ldsm_x4_trans(a[i][kk], lp + 2 * (kk * 16 * LD + 16 * i));
}

// Query rows per block of the forward and dQ kernels: W warps of M groups of 16 rows (64, or
// 128: FUGU_FLASH_QUERY_ROWS, the host's FlashQueryRows). Key blocks stay FA_ROWS keys.
#define FA_QROWS(M, W) (16 * (M) * (W))

// The last key block a query block of QR rows from q0 sees (causal; nkb key blocks in all).
__device__ i64 fa_last_key_block(i64 q0, int QR, i64 nkb) {
    i64 last = (q0 + QR - 1) / FA_ROWS;
    return last < nkb - 1 ? last : nkb - 1;
}

// Whether a backward kernel with M row groups per warp and tiles D wide reads its own tile's A
// fragments (Q and dO, or K and V) again on every loop step, from dynamic shared memory where
// the tile stays, instead of holding them in registers from before the loop: with two groups,
// or heads of 128, the registers go to the accumulators (twice as many either way).
#define FA_REREAD(M, D) ((M) > 1 || (D) > FA_STATIC_D)

// acc[i] (16 × 64) = A[i] (16 × D, fragments) · Bᵀ for each of a warp's M row groups, B the
// 64 rows of tile `s` (64 × D), read by ldmatrix (32 columns per ldmatrix.x4): each B fragment
// loaded from shared memory serves M products.
template <typename T, int M, int D>
__device__ void fa_mma_abt_m(float (*acc)[FA_ROWS / 8][4], u32 (*a)[D / 16][4], T* s) {
    int lane = threadIdx.x % WARP;
    smem_t lp = smem(s) + 2 * ((lane & 7) * FA_LDS(D) + (lane >> 3) * 8);
#pragma unroll
    for (int n = 0; n < FA_ROWS / 8; n++) {
#pragma unroll
        for (int i = 0; i < M; i++) acc[i][n][0] = acc[i][n][1] = acc[i][n][2] = acc[i][n][3] = 0.0f;
#pragma unroll
        for (int kd = 0; kd < D / 16; kd += 2) {
            u32 b[4];
            ldsm_x4(b, lp + 2 * (n * 8 * FA_LDS(D) + kd * 16));
#pragma unroll
            for (int i = 0; i < M; i++) {
                mma16816(acc[i][n], a[i][kd], b, T());
                mma16816(acc[i][n], a[i][kd + 1], b + 2, T());
            }
        }
    }
}

// P (16 × 64, accumulator layout) rounded to T as A fragments (16 keys per fragment).
template <typename T>
__device__ void fa_pack(u32 (*pa)[4], float (*p)[4]) {
#pragma unroll
    for (int kk = 0; kk < FA_ROWS / 16; kk++) {
        pa[kk][0] = pack2<T>(p[2 * kk][0], p[2 * kk][1]);
        pa[kk][1] = pack2<T>(p[2 * kk][2], p[2 * kk][3]);
        pa[kk][2] = pack2<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        pa[kk][3] = pack2<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
    }
}

// Element e (the accumulator layout's index) of n-chunk n of packed fragments `pa`, widened.
template <typename T>
__device__ float fa_unpack(u32 (*pa)[4], int n, int e) {
    T x;
    u32 w = pa[n / 2][(n & 1) * 2 + (e >> 1)];
    x.bits = (unsigned short)((e & 1) ? w >> 16 : w & 0xffffu);
    return ld(x);
}

// acc[i] (16 × D) += P[i] (16 × 64, packed A fragments) · B for each of a warp's M row
// groups, B the row-major tile `s` (64 × D), read transposed by ldmatrix (16 columns per
// ldmatrix.x4): each B fragment serves M products.
template <typename T, int M, int D>
__device__ void fa_mma_pb_m(float (*acc)[D / 8][4], u32 (*pa)[FA_ROWS / 16][4], T* s) {
    int lane = threadIdx.x % WARP;
    smem_t lp = smem(s) + 2 * (((lane & 8) + (lane & 7)) * FA_LDS(D) + (lane >> 4) * 8);
#pragma unroll
    for (int kk = 0; kk < FA_ROWS / 16; kk++)
#pragma unroll
        for (int nd = 0; nd < D / 16; nd++) {
            u32 b[4];
            ldsm_x4_trans(b, lp + 2 * (kk * 16 * FA_LDS(D) + nd * 16));
#pragma unroll
            for (int i = 0; i < M; i++) {
                mma16816(acc[i][2 * nd], pa[i][kk], b, T());
                mma16816(acc[i][2 * nd + 1], pa[i][kk], b + 2, T());
            }
        }
}

__device__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// The rotary embedding the attention backward's dQ and dK stores undo (Backend::
// attention_backward's `rope`): `table` the cosines (p positions × D / 2), then the sines; no
// table, no rotation. Only for heads of exactly D columns (the host runs the rope kernel
// otherwise): each lane then holds columns c and c + D / 2 of its rows (accumulators nd and
// nd + D / 16).
struct FaRope {
    const float* table;
    i64 p;
};

// x rounded to T, as a store and a load of it give.
template <typename T>
__device__ float fa_round(float x) {
    T v;
    st(v, x);
    return ld(v);
}

// Calls f(nd, e, row, c) for each of a warp's N accumulators of 8 columns (nd) and their 4
// entries (e: rows g and g + 8 from row0, columns 2t and 2t + 1 of the 8).
template <int N, typename F>
__device__ void fa_each_acc(i64 row0, F f) {
    int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nd = 0; nd < N; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) f(nd, e, row0 + g + (e >> 1) * 8, nd * 8 + 2 * t + (e & 1));
}

// Stores a warp's 16 × hs accumulator tile at rows row0.. of a row-major matrix (row stride
// ldq; rows from Tn on and columns from hs on are dropped), times mul[0] (rows g) and mul[1]
// (rows g + 8); D / 8 accumulators of 8 columns. With `rope` (heads of D columns), the rows
// (positions row0..) rotated back as rope_k with dir = −1 does after a plain store: each pair
// of columns (c, c + D / 2) rounded to T, rotated by rope_pair, rounded again: the same bits.
template <typename T, int D>
__device__ void fa_store(T* dst, float (*acc)[4], i64 row0, i64 Tn, i64 ldq, int hs,
                         const float* mul, FaRope rope = FaRope{nullptr, 0}) {
    if (rope.table != nullptr && hs == D) {
        constexpr int H = D / 2;
        fa_each_acc<D / 16>(row0, [&](int nd, int e, i64 row, int c) {
            if (row >= Tn) return;
            float x0 = fa_round<T>(acc[nd][e] * mul[e >> 1]),
                  x1 = fa_round<T>(acc[nd + D / 16][e] * mul[e >> 1]);
            const float* cs = rope.table + row * H + c;
            rope_pair(x0, x1, cs[0], -1.0f * cs[rope.p * H]);
            st(dst[row * ldq + c], x0);
            st(dst[row * ldq + c + H], x1);
        });
        return;
    }
    fa_each_acc<D / 8>(row0, [&](int nd, int e, i64 row, int c) {
        if (row < Tn && c < hs) st(dst[row * ldq + c], acc[nd][e] * mul[e >> 1]);
    });
}

// Sets the entries of a diagonal tile's accumulators above the diagonal (local column after
// local row; rows of this warp from `row`), or with `below` those below it, to `v`.
__device__ void fa_mask(float (*acc)[4], int row, float v, bool below) {
    int lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int col = n * 8 + 2 * t + (e & 1), r = row + g + (e >> 1) * 8;
            if (below ? col < r : col > r) acc[n][e] = v;
        }
}

// The dynamic shared memory after the first n tiles of width D there: fa_tiles puts a kernel's
// tiles there for D = 128 only (for 64, at its start), from the first 1024-byte boundary (the
// swizzled tiles' need; dynamic memory starts after the static, at no such boundary: the host
// adds FLASH_TILE_ALIGN bytes, d128_shmem).
template <typename T, int D>
__device__ T* fa_dynamic(int n) {
    DYNAMIC_SHARED(Pack<float>, dyn);
    char* base = reinterpret_cast<char*>(dyn);
    if constexpr (D > FA_STATIC_D)
        base += (1024 - ((unsigned long long)smem(base) & 1023)) & 1023;
    return reinterpret_cast<T*>(base) + (D > FA_STATIC_D ? n : 0) * FA_ROWS * FA_LDS(D);
}

// A kernel's N shared-memory tiles of FA_ROWS rows × D (row stride FA_LDS(D)), 1024-byte
// aligned (the swizzled tiles' need): for D = 64 a static array (ID tells a kernel's arrays
// apart), within the 48 KB a kernel may declare; for D = 128 (18 KB a tile) tiles `at` ..
// `at` + N of the dynamic shared memory, which the host sizes (flash_tiles_shmem).
template <typename T, int D, int N, int ID>
__device__ T (*fa_tiles(int at))[FA_ROWS * FA_LDS(D)] {
    typedef T Tile[FA_ROWS * FA_LDS(D)];
    if constexpr (D <= FA_STATIC_D) {
        alignas(1024) __shared__ Tile s[N];
        return s;
    } else {
        return reinterpret_cast<Tile*>(fa_dynamic<T, D>(at));
    }
}

// One key block's step of the forward's online softmax for a group of 16 rows: s (their raw
// scores, masked from row `row` of the block where `mask`) becomes P, packed into pa; the
// running maximum m and this lane's part of the running sum l move on; corr is each of the
// lane's two rows' rescale of what was summed before, for the caller to apply to its output
// accumulators (after the product still reading them, where one is in flight).
template <typename T>
__device__ void fa_softmax_step(float (*s)[4], u32 (*pa)[4], float* m, float* l, float* corr,
                                bool mask, int row, float sl2) {
    if (mask) fa_mask(s, row, NEG_INF, false);
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float neg[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        // Column 0 is in every row's first key block: m is finite from then on.
        mx[r] = quad_max(mx[r]);
        corr[r] = fast_exp2((m[r] - mx[r]) * sl2);
        m[r] = mx[r];
        neg[r] = -mx[r] * sl2;
        l[r] *= corr[r];
    }
#pragma unroll
    for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            s[n][e] = fast_exp2(fmaf(s[n][e], sl2, neg[e >> 1]));
            l[e >> 1] += s[n][e];
        }
    fa_pack<T>(pa, s);
}
// o (a 16-row group's output accumulators over D columns) scaled per row by corr.
template <int D>
__device__ void fa_rescale(float (*o)[4], const float* corr) {
#pragma unroll
    for (int nd = 0; nd < D / 8; nd++) {
        o[nd][0] *= corr[0];
        o[nd][1] *= corr[0];
        o[nd][2] *= corr[1];
        o[nd][3] *= corr[1];
    }
}

// Forward: out (B, T, C) and lse (B, nh, T), the log-sum-exp of each row's scaled scores.
// qkv rows are [q (nh heads) | k (kvh heads) | v (kvh heads)]: query head h reads key/value
// head h / (nh / kvh) (grouped-query attention; kvh = nh without it).
// Item = (query block, sequence, head), the longest query blocks first. K and V tiles are
// double-buffered: the copies of key block kb + 1 run while block kb is multiplied. Each of
// the block's FA_ROWS / (16·M) warps owns M groups of 16 query rows (FLASH_WARP_ROWS = 16·M
// on the host): with M = 2 every K and V fragment a warp loads from shared memory feeds two
// products instead of one (FlashAttention-2 gives a warp 32 rows), for twice the registers.
// With WG (flash_forward_wgmma, sm_90a) the block's one warpgroup multiplies with wgmma, the
// tensor cores reading K and V from swizzled tiles (the "warpgroup MMA" section above); the
// rest, softmax included, is the same code. Heads of up to D columns (64; 128 for the _d128
// kernel, its four tiles in dynamic shared memory).
//
// With OVL (flash_forward_wgmma_overlap, FUGU_FLASH_OVERLAP=on) each warpgroup overlaps a key
// block's softmax with the previous block's P·V product, FlashAttention-3's intra-warpgroup
// pipelining: it issues S = Q·Kᵀ of block kb and O += P·V of block kb - 1 together, waits for
// S alone (wg_wait1), computes block kb's P while the P·V product runs, then waits for it and
// rescales O. The sums are the same, in the same order, as without (O rescaled after adding
// block kb - 1's P·V rather than before adding block kb's). V's tile of block kb - 1 is read
// while block kb's K and V tiles are in use, so K and V load separately: K of block kb + 1 at
// the top of the step, V of block kb + 1 after the step's P·V product has waited. A warpgroup
// whose rows all come before a key block does not skip it (its scores are all masked, its P
// zero: the same sums).
template <typename T, int D, int M, int W, bool WG = false, bool OVL = false>
__device__ void flash_forward_k(T* out, float* lse, const T* qkv, i64 B, i64 Tn, i64 nh,
                                i64 kvh, i64 hs_, float scale) {
    constexpr int QR = FA_QROWS(M, W);
    static_assert(QR <= 2 * FA_ROWS, "Q is loaded into key block 1's two tiles");
    // With WG each warpgroup (4 warps) owns 64 of the block's rows; a warpgroup's warps skip
    // a key tile together (key blocks and warpgroups are both 64-row aligned).
    static_assert(!WG || (M == 1 && W % 4 == 0 && D % FA_WG_D == 0),
                  "wgmma: warpgroups of 16-row warps");
    static_assert(!OVL || WG, "the overlapped steps are wgmma's");
    // Key block c's tiles: K in sKV[2c], V in sKV[2c + 1]; Q (QR rows) first in block 1's.
    // With WG, K and V in the 128-byte swizzle (each tile 1024-byte aligned: 9 KB apart).
    auto sKV = fa_tiles<T, D, 4, 0>(0);
    int hs = (int)hs_, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane >> 2,
        t = lane & 3, w0 = warp * 16 * M;
    float sl2 = scale * LOG2E;  // raw scores to log2 units
    i64 C = nh * hs, ldq = (nh + 2 * kvh) * hs, grp = nh / kvh, nqb = (Tn + QR - 1) / QR,
        nkb = (Tn + FA_ROWS - 1) / FA_ROWS;
    bool vec = fa_vec_ok(qkv, hs, ldq);
    for (i64 item = blockIdx.x; item < B * nh * nqb; item += gridDim.x) {
        i64 qb = nqb - 1 - item / (B * nh), bh = item % (B * nh), b = bh / nh, h = bh % nh;
        i64 q0 = qb * QR, kend = QR > FA_ROWS ? fa_last_key_block(q0, QR, nkb) : qb;
        const T* base = qkv + b * Tn * ldq + h * hs;
        const T* kbase = qkv + b * Tn * ldq + C + (h / grp) * hs;
        const T* vbase = kbase + kvh * hs;
        __syncthreads();  // the previous item's reads are done
        for (int r = 0; r < QR; r += FA_ROWS)  // Q, in the tiles block 1 will use
            fa_load<T, D>(sKV[2] + r * FA_LDS(D), base, q0 + r, Tn, ldq, hs, vec);
        fa_load<T, D, WG>(sKV[0], kbase, 0, Tn, ldq, hs, vec);
        fa_load<T, D, WG>(sKV[1], vbase, 0, Tn, ldq, hs, vec);
        cp_async_wait_all();
        if constexpr (WG) wg_fence_tiles();
        __syncthreads();
        u32 qa[M][D / 16][4];
        fa_a_frags_m<T, M, D>(qa, sKV[2], w0);
        // m: running maximum of the raw scores; l: this lane's part of the running sum (per
        // row group, rows g and g + 8).
        float m[M][2], l[M][2], o[M][D / 8][4];
#pragma unroll
        for (int i = 0; i < M; i++) {
            m[i][0] = m[i][1] = NEG_INF;
            l[i][0] = l[i][1] = 0.0f;
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
                o[i][nd][0] = o[i][nd][1] = o[i][nd][2] = o[i][nd][3] = 0.0f;
        }
        if constexpr (OVL) {
            // Block 0's scores and P (no product in flight yet); K of block 1 loads meanwhile.
            __syncthreads();  // every warp has its Q fragments: block 1's tiles are free
            if (kend > 0) fa_load<T, D, WG>(sKV[2], kbase, FA_ROWS, Tn, ldq, hs, vec);
            cp_async_commit();
            // P of the block before kb, read by its P·V product until that waits.
            u32 pa[FA_ROWS / 16][4];
            {
                float s[FA_ROWS / 8][4], corr[2];
                fa_wg_abt<T, D>(s, qa[0], sKV[0]);
                int off = QR > FA_ROWS ? (int)(q0 + w0) : w0;
                bool mask = QR > FA_ROWS ? off < FA_ROWS - 1 : qb == 0;
                fa_softmax_step<T>(s, pa, m[0], l[0], corr, mask, off, sl2);
            }
            if (kend > 0) fa_load<T, D, WG>(sKV[3], vbase, FA_ROWS, Tn, ldq, hs, vec);
            cp_async_commit();
            for (i64 kb = 1; kb <= kend; kb++) {
                int cur = (int)(kb & 1);
                cp_async_wait_prior();  // block kb's K (and block kb - 1's V) landed
                wg_fence_tiles();
                __syncthreads();  // and no warp reads block kb - 1's K any more
                if (kb < kend)
                    fa_load<T, D, WG>(sKV[2 * (cur ^ 1)], kbase, (kb + 1) * FA_ROWS, Tn, ldq,
                                      hs, vec);
                cp_async_commit();
                float s[FA_ROWS / 8][4], corr[2];
                wg_fence_acc<D / 8>(o[0]);
                wg_fence();
                fa_wg_abt_issue<T, D>(s, qa[0], sKV[2 * cur]);
                wg_commit();
                fa_wg_pb_issue<T, D>(o[0], pa, sKV[2 * (cur ^ 1) + 1]);
                wg_commit();
                wg_wait1();  // S of block kb; block kb - 1's P·V may still run
                wg_fence_acc<FA_ROWS / 8>(s);
                int off = QR > FA_ROWS ? (int)(q0 + w0 - kb * FA_ROWS) : w0;
                bool mask = QR > FA_ROWS ? off < FA_ROWS - 1 : kb == qb;
                u32 pn[FA_ROWS / 16][4];
                fa_softmax_step<T>(s, pn, m[0], l[0], corr, mask, off, sl2);
                wg_wait();  // block kb - 1's P·V: O and pa are free
                wg_fence_acc<D / 8>(o[0]);
                wg_fence_frags<FA_ROWS / 16>(pa);
                fa_rescale<D>(o[0], corr);
#pragma unroll
                for (int kk = 0; kk < FA_ROWS / 16; kk++)
#pragma unroll
                    for (int j = 0; j < 4; j++) pa[kk][j] = pn[kk][j];
                __syncthreads();  // no warpgroup reads block kb - 1's V any more
                if (kb < kend)
                    fa_load<T, D, WG>(sKV[2 * (cur ^ 1) + 1], vbase, (kb + 1) * FA_ROWS, Tn,
                                      ldq, hs, vec);
                cp_async_commit();
            }
            // The last block's P·V (its V tile loaded a step ago, or before the loop).
            cp_async_wait_all();
            wg_fence_tiles();
            __syncthreads();
            fa_wg_pb<T, D>(o[0], pa, sKV[2 * (kend & 1) + 1]);
        } else {
            for (i64 kb = 0; kb <= kend; kb++) {
                int cur = (int)(kb & 1);
                __syncthreads();  // buffer cur ^ 1 (Q, or block kb - 1) is no longer read
                if (kb < kend) {
                    fa_load<T, D, WG>(sKV[2 * (cur ^ 1)], kbase, (kb + 1) * FA_ROWS, Tn, ldq, hs,
                                      vec);
                    fa_load<T, D, WG>(sKV[2 * (cur ^ 1) + 1], vbase, (kb + 1) * FA_ROWS, Tn, ldq,
                                      hs, vec);
                }
                cp_async_commit();
                cp_async_wait_prior();  // block kb's tiles have landed
                if constexpr (WG) wg_fence_tiles();
                __syncthreads();
                // This warp's first row, counted from the key block's first key (w0 on the
                // diagonal block of a 64-row query block, compiled as before for those).
                int off = QR > FA_ROWS ? (int)(q0 + w0 - kb * FA_ROWS) : w0;
                if (QR > FA_ROWS && off + 16 * M <= 0) continue;  // every key after every row
                float s[M][FA_ROWS / 8][4];
                if constexpr (WG)
                    fa_wg_abt<T, D>(s[0], qa[0], sKV[2 * cur]);
                else
                    fa_mma_abt_m<T, M, D>(s, qa, sKV[2 * cur]);
                u32 pa[M][FA_ROWS / 16][4];
#pragma unroll
                for (int i = 0; i < M; i++) {
                    bool mask = QR > FA_ROWS ? off + 16 * i < FA_ROWS - 1 : kb == qb;
                    float corr[2];
                    fa_softmax_step<T>(s[i], pa[i], m[i], l[i], corr, mask, off + 16 * i, sl2);
                    fa_rescale<D>(o[i], corr);
                }
                if constexpr (WG)
                    fa_wg_pb<T, D>(o[0], pa[0], sKV[2 * cur + 1]);
                else
                    fa_mma_pb_m<T, M, D>(o, pa, sKV[2 * cur + 1]);
            }
        }
#pragma unroll
        for (int i = 0; i < M; i++) {
            i64 r0 = q0 + w0 + 16 * i + g;
            float inv[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                l[i][r] = quad_sum(l[i][r]);
                inv[r] = 1.0f / l[i][r];
                if (t == 0 && r0 + 8 * r < Tn)
                    lse[bh * Tn + r0 + 8 * r] = m[i][r] * scale + logf(l[i][r]);
            }
            fa_store<T, D>(out + b * Tn * C + h * hs, o[i], q0 + w0 + 16 * i, Tn, C, hs, inv);
        }
    }
}
// The forward kernel's forms: NAME_S with W warps of M groups of 16 query rows per block,
// heads of up to D columns, compiled for MINB blocks per SM.
#define FA_FWD(S, T, NAME, D, M, W, MINB)                                                    \
    extern "C" __global__ void __launch_bounds__(WARP * (W), MINB)                           \
        NAME##_##S(T* out, float* lse, const T* qkv, i64 B, i64 Tn, i64 nh, i64 kvh, i64 hs, \
                   float scale) {                                                            \
        flash_forward_k<T, D, M, W>(out, lse, qkv, B, Tn, nh, kvh, hs, scale);               \
    }
// The warpgroup-MMA forms (FUGU_FLASH_MMA=wgmma): W warps of 16 rows, one or two warpgroups,
// heads of up to D columns, each step's softmax overlapped with the last one's P·V or not.
#define FA_FWD_WG(S, T, NAME, D, W, MINB, OVL)                                               \
    extern "C" __global__ void __launch_bounds__(WARP * (W), MINB)                           \
        NAME##_##S(T* out, float* lse, const T* qkv, i64 B, i64 Tn, i64 nh, i64 kvh, i64 hs, \
                   float scale) {                                                            \
        flash_forward_k<T, D, 1, W, true, OVL>(out, lse, qkv, B, Tn, nh, kvh, hs, scale);    \
    }
#define DEF(S, T)                                                                            \
    FA_FWD(S, T, flash_forward, 64, 1, 4, FA_MINB_FWD)                                       \
    FA_FWD(S, T, flash_forward_wide, 64, 2, 2, FA_MINB_FWD_WIDE)                             \
    FA_FWD(S, T, flash_forward_q128, 64, 1, 8, FA_MINB_FWD / 2)                              \
    FA_FWD(S, T, flash_forward_wide_q128, 64, 2, 4, FA_MINB_FWD_WIDE / 2)                  \
    FA_FWD(S, T, flash_forward_d128, 128, 1, 4, FA_MINB_FWD_D128)                            \
    FA_FWD_WG(S, T, flash_forward_wgmma, 64, 4, FA_MINB_FWD, false)                          \
    FA_FWD_WG(S, T, flash_forward_wgmma_q128, 64, 8, FA_MINB_FWD / 2, false)                 \
    FA_FWD_WG(S, T, flash_forward_wgmma_d128, 128, 4, FA_MINB_FWD_D128, false)               \
    FA_FWD_WG(S, T, flash_forward_wgmma_d128_q128, 128, 8, FA_MINB_FWD_D128_Q128, false)     \
    FA_FWD_WG(S, T, flash_forward_wgmma_overlap, 64, 4, FA_MINB_FWD_OVL, true)               \
    FA_FWD_WG(S, T, flash_forward_wgmma_overlap_q128, 64, 8, FA_MINB_FWD_OVL / 2, true)      \
    FA_FWD_WG(S, T, flash_forward_wgmma_overlap_d128, 128, 4, FA_MINB_FWD_D128, true)        \
    FA_FWD_WG(S, T, flash_forward_wgmma_overlap_d128_q128, 128, 8, FA_MINB_FWD_D128_Q128, true)
FOR_HALF_TYPES(DEF)
#undef DEF
#undef FA_FWD_WG
#undef FA_FWD

// Δ = rowsum(dO ∘ O) of query rows row0 .. row0+64 (dO in the shared tile `sdo`, O the rows of
// `ob` with row stride C) into `delta` (global, rows before Tn) and `sd`, and −lse·log2(e)
// into `sl` (+∞ past Tn: probabilities 0), for the dQ kernel. With `vec` (O's rows in 16-byte
// packs), D / 8 lanes per row each take one pack of the row's D (zero-padded) columns, O read
// coalesced (a row's 2·D bytes by neighbouring lanes), and add theirs in a butterfly;
// otherwise a thread per row runs along it.
template <typename T, int D>
__device__ void fa_delta(float* sd, float* sl, float* delta, const float* lse, const T* sdo,
                         const T* ob, i64 row0, i64 Tn, i64 C, int hs, bool vec) {
    if (vec) {
        for (int i = threadIdx.x; i < FA_ROWS * (D / 8); i += blockDim.x) {
            int r = i / (D / 8), c = (i % (D / 8)) * 8;
            i64 row = row0 + r;
            float s = 0.0f;
            if (row < Tn && c < hs) {
                Pack<T> o = ld_pack(ob + row * C + c), d = ld_pack(sdo + r * FA_LDS(D) + c);
                for (int j = 0; j < 8; j++) s += ld(d.v[j]) * ld(o.v[j]);
            }
#pragma unroll
            for (int x = 1; x < D / 8; x *= 2) s += __shfl_xor_sync(0xffffffffu, s, x);
            if (c == 0) {
                if (row < Tn) delta[row] = s;
                sd[r] = s;
                sl[r] = row < Tn ? lse[row] * LOG2E : POS_INF;
            }
        }
        return;
    }
    if (threadIdx.x < FA_ROWS) {
        i64 row = row0 + threadIdx.x;
        float s = 0.0f, l2 = POS_INF;
        if (row < Tn) {
            for (int c = 0; c < hs; c++)
                s += ld(sdo[threadIdx.x * FA_LDS(D) + c]) * ld(ob[row * C + c]);
            delta[row] = s;
            l2 = lse[row] * LOG2E;
        }
        sd[threadIdx.x] = s;
        sl[threadIdx.x] = l2;
    }
}

// Backward, part 1: the Q columns of dqkv, and delta (B, nh, T) = rowsum(dout ∘ out), which
// part 2 reads. Item = (query block, sequence, head), the longest first; K and V tiles
// double-buffered as in the forward kernel; M groups of 16 query rows per warp, as there.
// With two groups the Q and dO fragments are read again from shared memory for every key
// block (the registers go to the accumulators), so Q and dO stay in dynamic shared memory
// (FLASH_KV_SHMEM bytes) instead of the buffers key block 1 then fills. Heads of up to D
// columns (the _d128 kernel: 128, every tile in dynamic shared memory, Q and dO after K and V).
template <typename T, int D, int M, int W>
__device__ void flash_backward_dq_k(T* dqkv, float* delta, const T* dout, const T* out,
                                    const float* lse, const T* qkv, i64 B, i64 Tn, i64 nh,
                                    i64 kvh, i64 hs_, float scale, FaRope rope) {
    constexpr int QR = FA_QROWS(M, W);
    constexpr bool REREAD = FA_REREAD(M, D);
    // Q and dO in dynamic shared memory (FlashQueryRows::dq_shmem on the host) where they are
    // read again on every key block or are taller than one tile; else in block 1's tiles.
    constexpr bool QDO_DYNAMIC = REREAD || QR > FA_ROWS;
    // Key block c's tiles: K in sKV[2c], V in sKV[2c + 1].
    auto sKV = fa_tiles<T, D, 4, 0>(0);
    __shared__ float sL[QR], sD[QR];
    T* sQ = QDO_DYNAMIC ? fa_dynamic<T, D>(4) : sKV[2];
    T* sDO = QDO_DYNAMIC ? sQ + QR * FA_LDS(D) : sKV[3];
    int hs = (int)hs_, warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane >> 2,
        w0 = warp * 16 * M;
    float sl2 = scale * LOG2E;
    i64 C = nh * hs, ldq = (nh + 2 * kvh) * hs, grp = nh / kvh, nqb = (Tn + QR - 1) / QR,
        nkb = (Tn + FA_ROWS - 1) / FA_ROWS;
    bool vec = fa_vec_ok(qkv, hs, ldq), vec_o = fa_vec_ok(dout, hs, C),
         vec_delta = vec_o && fa_vec_ok(out, hs, C);
    for (i64 item = blockIdx.x; item < B * nh * nqb; item += gridDim.x) {
        i64 qb = nqb - 1 - item / (B * nh), bh = item % (B * nh), b = bh / nh, h = bh % nh;
        i64 q0 = qb * QR, kend = QR > FA_ROWS ? fa_last_key_block(q0, QR, nkb) : qb;
        const T* base = qkv + b * Tn * ldq + h * hs;
        const T* kbase = qkv + b * Tn * ldq + C + (h / grp) * hs;
        const T* vbase = kbase + kvh * hs;
        const T* dob = dout + b * Tn * C + h * hs;
        const T* ob = out + b * Tn * C + h * hs;
        __syncthreads();
        for (int r = 0; r < QR; r += FA_ROWS) {  // Q and dO
            fa_load<T, D>(sQ + r * FA_LDS(D), base, q0 + r, Tn, ldq, hs, vec);
            fa_load<T, D>(sDO + r * FA_LDS(D), dob, q0 + r, Tn, C, hs, vec_o);
        }
        fa_load<T, D>(sKV[0], kbase, 0, Tn, ldq, hs, vec);
        fa_load<T, D>(sKV[1], vbase, 0, Tn, ldq, hs, vec);
        cp_async_wait_all();
        __syncthreads();
        u32 qa[M][D / 16][4], da[M][D / 16][4];
        if constexpr (!REREAD) {
            fa_a_frags_m<T, M, D>(qa, sQ, w0);
            fa_a_frags_m<T, M, D>(da, sDO, w0);
        }
        for (int r = 0; r < QR; r += FA_ROWS)
            fa_delta<T, D>(sD + r, sL + r, delta + bh * Tn, lse + bh * Tn, sDO + r * FA_LDS(D), ob,
                     q0 + r, Tn, C, hs, vec_delta);
        __syncthreads();
        float nl[M][2], dr[M][2], dq[M][D / 8][4];
#pragma unroll
        for (int i = 0; i < M; i++) {
            int r = w0 + 16 * i + g;
            nl[i][0] = -sL[r];
            nl[i][1] = -sL[r + 8];
            dr[i][0] = sD[r];
            dr[i][1] = sD[r + 8];
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
                dq[i][nd][0] = dq[i][nd][1] = dq[i][nd][2] = dq[i][nd][3] = 0.0f;
        }
        for (i64 kb = 0; kb <= kend; kb++) {
            int cur = (int)(kb & 1);
            __syncthreads();
            if (kb < kend) {
                fa_load<T, D>(sKV[2 * (cur ^ 1)], kbase, (kb + 1) * FA_ROWS, Tn, ldq, hs, vec);
                fa_load<T, D>(sKV[2 * (cur ^ 1) + 1], vbase, (kb + 1) * FA_ROWS, Tn, ldq, hs, vec);
            }
            cp_async_commit();
            cp_async_wait_prior();
            __syncthreads();
            // This warp's first row, counted from the key block's first key (w0 on the
            // diagonal block of a 64-row query block, compiled as before for those).
            int off = QR > FA_ROWS ? (int)(q0 + w0 - kb * FA_ROWS) : w0;
            if (QR > FA_ROWS && off + 16 * M <= 0) continue;  // every key after every row
            T* sK = sKV[2 * cur];
            // P rounded to T (as the three-step path stores it), then dS = P ∘ (dP − Δ).
            u32 pa[M][FA_ROWS / 16][4];
            if constexpr (REREAD) fa_a_frags_m<T, M, D>(qa, sQ, w0);
            {
                float s[M][FA_ROWS / 8][4];
                fa_mma_abt_m<T, M, D>(s, qa, sK);
#pragma unroll
                for (int i = 0; i < M; i++) {
                    if (QR > FA_ROWS ? off + 16 * i < FA_ROWS - 1 : kb == qb)
                        fa_mask(s[i], off + 16 * i, NEG_INF, false);
#pragma unroll
                    for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            s[i][n][e] = fast_exp2(fmaf(s[i][n][e], sl2, nl[i][e >> 1]));
                    fa_pack<T>(pa[i], s[i]);
                }
            }
            float dp[M][FA_ROWS / 8][4];
            if constexpr (REREAD) fa_a_frags_m<T, M, D>(da, sDO, w0);
            fa_mma_abt_m<T, M, D>(dp, da, sKV[2 * cur + 1]);
#pragma unroll
            for (int i = 0; i < M; i++) {
#pragma unroll
                for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        dp[i][n][e] = fa_unpack<T>(pa[i], n, e) * (dp[i][n][e] - dr[i][e >> 1]);
                fa_pack<T>(pa[i], dp[i]);
            }
            fa_mma_pb_m<T, M, D>(dq, pa, sK);
        }
        float mul[2] = {scale, scale};
#pragma unroll
        for (int i = 0; i < M; i++)
            fa_store<T, D>(dqkv + b * Tn * ldq + h * hs, dq[i], q0 + w0 + 16 * i, Tn, ldq, hs, mul,
                           rope);
    }
}
// The dQ kernel's forms, as the forward's (FA_FWD).
#define FA_DQ(S, T, NAME, D, M, W, MINB)                                                     \
    extern "C" __global__ void __launch_bounds__(WARP * (W), MINB)                           \
        NAME##_##S(T* dqkv, float* delta, const T* dout, const T* out, const float* lse,     \
                   const T* qkv, i64 B, i64 Tn, i64 nh, i64 kvh, i64 hs, float scale,        \
                   const float* rope, i64 rope_p) {                                          \
        flash_backward_dq_k<T, D, M, W>(dqkv, delta, dout, out, lse, qkv, B, Tn, nh, kvh,    \
                                        hs, scale, FaRope{rope, rope_p});                    \
    }
#define DEF(S, T)                                                                            \
    FA_DQ(S, T, flash_backward_dq, 64, 1, 4, FA_MINB_DQ)                                     \
    FA_DQ(S, T, flash_backward_dq_wide, 64, 2, 2, FA_MINB_DQ_WIDE)                           \
    FA_DQ(S, T, flash_backward_dq_q128, 64, 1, 8, FA_MINB_DQ / 2)                            \
    FA_DQ(S, T, flash_backward_dq_wide_q128, 64, 2, 4, FA_MINB_DQ_WIDE / 2)                  \
    FA_DQ(S, T, flash_backward_dq_d128, 128, 1, 4, FA_MINB_DQ_D128)
FOR_HALF_TYPES(DEF)
#undef DEF
#undef FA_DQ

// The per-row statistics of query rows row0.. for the dK/dV kernel: −lse·log2(e) (−∞ past T:
// probabilities 0) and delta (0 past T).
__device__ void fa_load_stats(float* sl, float* sd, const float* lse, const float* delta,
                              i64 row0, i64 Tn) {
    if (threadIdx.x < FA_ROWS) {
        i64 row = row0 + threadIdx.x;
        sl[threadIdx.x] = row < Tn ? -lse[row] * LOG2E : NEG_INF;
        sd[threadIdx.x] = row < Tn ? delta[row] : 0.0f;
    }
}

// The next work item of a block of the fused attention kernels after `prev` (-1: its first),
// the same for every thread: blockIdx.x, then strides of gridDim.x; or (Ticket, the one-kernel
// backward) the next value of the counter sync[0], in the order blocks ask.
template <bool Ticket>
__device__ i64 fa_next_item(i64 prev, int* sync, i64* s_item) {
    if constexpr (Ticket) {
        __syncthreads();  // every thread has read the previous item
        if (threadIdx.x == 0) *s_item = atomicAdd(sync, 1);
        __syncthreads();
        return *s_item;
    } else {
        return prev < 0 ? (i64)blockIdx.x : prev + gridDim.x;
    }
}

// Adds key block kb's share `dq` of query block qb's dQ (this warp's M groups of 16 rows from
// w0), in turn: waits until key block kb − 1 has added its share (*turn == kb); the first share
// (kb = 0) is stored, later ones are added to what is stored, and the last (the diagonal tile,
// kb = qb) writes dQ = scale · sum into `dst` (the (sequence, head)'s Q columns, row stride
// ldq); then passes the turn on. `acc` is the query block's 64 × 64 f32 tile laid out as the
// accumulators are held (row group of 16, element of a lane's D / 2, lane): a warp's
// accesses are 128 contiguous bytes.
template <typename T, int M, int D>
__device__ void fa_add_dq_share(float* acc, int* turn, float (*dq)[D / 8][4], i64 kb, i64 qb,
                                T* dst, i64 Tn, i64 ldq, int hs, float scale, int w0,
                                FaRope rope) {
    if (threadIdx.x == 0) fa_wait_turn(turn, (int)kb);
    __syncthreads();
    int lane = threadIdx.x % WARP;
    float mul[2] = {scale, scale};
#pragma unroll
    for (int i = 0; i < M; i++) {
        float* a = acc + (w0 / 16 + i) * (D / 2) * WARP + lane;
#pragma unroll
        for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float* p = a + (nd * 4 + e) * WARP;
                float v = dq[i][nd][e];
                if (kb > 0) v = __ldcg(p) + v;  // the earlier shares' sum, then this one
                if (kb < qb) __stcg(p, v);
                dq[i][nd][e] = v;
            }
        if (kb == qb)
            fa_store<T, D>(dst, dq[i], qb * FA_ROWS + w0 + 16 * i, Tn, ldq, hs, mul, rope);
    }
    __threadfence();  // the shares stored are visible before the turn is passed
    __syncthreads();
    if (threadIdx.x == 0) *(volatile int*)turn = (int)kb + 1;
}

// Before the one-kernel backward (flash_backward_fused) and the dK/dV kernel that stores dS:
// delta (B, nh, T) = rowsum(dout ∘ out), L = D / 8 lanes per row (heads of at most D) each
// over 8 of its columns, added in a butterfly (rows not in 16-byte packs: one lane along the
// row), the same sums in the same order as fa_delta's; and `nsync` counters zeroed (the
// one-kernel backward's item counter and every query block's turn).
template <typename T, int D>
__device__ void flash_backward_prep_k(float* delta, int* sync, i64 nsync, const T* dout,
                                      const T* out, i64 B, i64 Tn, i64 nh, i64 hs) {
    constexpr int L = D / 8;
    GRID_STRIDE(i, stride);
    for (i64 k = i; k < nsync; k += stride) sync[k] = 0;
    i64 C = nh * hs, rows = B * nh * Tn;
    bool vec = fa_vec_ok(dout, (int)hs, C) && fa_vec_ok(out, (int)hs, C);
    int lane = threadIdx.x % WARP, c = (lane % L) * 8;
    // Whole warps run the loop (the butterfly needs every lane); stride is a multiple of 32.
    for (i64 w = i - lane; w < rows * L; w += stride) {
        i64 row = (w + lane) / L;
        float s = 0.0f;
        if (row < rows && c < hs) {
            i64 bh = row / Tn, tt = row % Tn, b = bh / nh, h = bh % nh;
            i64 at = (b * Tn + tt) * C + h * hs + c;
            if (vec) {
                Pack<T> d = ld_pack(dout + at), o = ld_pack(out + at);
                for (int j = 0; j < 8; j++) s += ld(d.v[j]) * ld(o.v[j]);
            } else if (c == 0) {  // the whole row in order, as fa_delta's element path
                for (int j = 0; j < hs; j++) s += ld(dout[at + j]) * ld(out[at + j]);
            }
        }
#pragma unroll
        for (int x = 1; x < L; x *= 2) s += __shfl_xor_sync(0xffffffffu, s, x);
        if (row < rows && c == 0) delta[row] = s;
    }
}
#define FA_PREP(S, T, NAME, D)                                                               \
    extern "C" __global__ void NAME##_##S(float* delta, int* sync, i64 nsync, const T* dout, \
                                          const T* out, i64 B, i64 Tn, i64 nh, i64 hs) {     \
        flash_backward_prep_k<T, D>(delta, sync, nsync, dout, out, B, Tn, nh, hs);           \
    }
#define DEF(S, T)                                                                            \
    FA_PREP(S, T, flash_backward_prep, 64)                                                   \
    FA_PREP(S, T, flash_backward_prep_d128, 128)
FOR_HALF_TYPES(DEF)
#undef DEF
#undef FA_PREP

// Backward, part 2: the K and V columns of dqkv. Item = (key block, sequence, key/value head),
// the longest (first key blocks) first; each block runs over the query heads that share the
// key/value head (one without grouped-query attention), summing their dK and dV, and for each
// over the query blocks from its own on, Q
// and dO tiles (and their statistics) double-buffered; M groups of 16 keys per warp (each Q
// and dO fragment loaded from shared memory feeds M products). With one group the block's K
// and V wait in the second Q and dO buffers until each warp holds its fragments in registers;
// with two, those registers go to the two groups' dK and dV accumulators (ptxas: about 400
// bytes of spills otherwise), so K and V stay in dynamic shared memory (FLASH_KV_SHMEM bytes,
// beyond the 48 KB of static memory) and each warp reads its fragments again for every query
// block.
//
// What the kernel does with each tile's dS besides multiplying it into dK: DS_DROP, nothing (the
// dQ kernel computes dS again); DS_STORE (FUGU_FLASH_BACKWARD=stored), stores it to `ds` for
// flash_backward_dq_stored (rounded to T as the products take it; keys × queries, row-major,
// FA_ROWS × FA_ROWS, the tiles of a (sequence, query head) one after another, query block qb's
// key blocks 0 ..= qb from tile qb·(qb + 1)/2 on), at T's size per element (GPT-2 124M B=16:
// 214 MB per layer); DS_TURNS, the one-kernel backward below.
//
// With DS_TURNS (the one-kernel backward, flash_backward_fused: FlashAttention-2's five products
// per tile instead of seven) the kernel also computes dQ: each tile's dS goes to shared memory
// (keys × queries, FLASH_FUSED_SHMEM: K and V stay in dynamic shared memory for the product)
// and the block's warps multiply it by K for the tile's query rows. The key blocks' shares of
// one query block's dQ are added in a fixed order, key block 0 first, through an f32
// accumulator in global memory (`dq_acc`, a 64 × 64 tile per query block of each (sequence,
// head), in the accumulators' register layout), each block waiting for its turn (`sync`) as
// FlashAttention-3's deterministic backward does; the last share (the diagonal tile) writes dQ
// itself. So that the shares of a query block come from the key blocks at about the same
// time, a block runs over the query blocks from the last down to its own. Items are handed out
// by a counter in the order blocks ask (sync[0]), so the item a block waits for has been taken
// by a running block (no wait on a block the GPU has not started, whatever its scheduling).
enum FaDs { DS_DROP, DS_STORE, DS_TURNS };
template <typename T, int D, int M, FaDs DS, bool WG = false>
__device__ void flash_backward_dkv_k(T* dqkv, const float* delta, const T* dout,
                                     const float* lse, const T* qkv, i64 B, i64 Tn, i64 nh,
                                     i64 kvh, i64 hs_, float scale, T* ds_out, float* dq_acc,
                                     int* sync, FaRope rope) {
    constexpr bool DQ = DS == DS_TURNS, REREAD = FA_REREAD(M, D);
    static_assert(!WG || (M == 1 && !DQ && D % FA_WG_D == 0),
                  "wgmma: one warpgroup of 16-key warps, no turns");
    // With WG, the Q and dO tiles in the 128-byte swizzle (K and V, read once into registers,
    // as they are). With D = 128 every tile in dynamic shared memory: Q, dO, then K and V.
    auto sQ = fa_tiles<T, D, 2, 0>(0);
    auto sO = fa_tiles<T, D, 2, 1>(2);
    __shared__ float sL[2][FA_ROWS], sD[2][FA_ROWS];
    __shared__ i64 s_item;
    constexpr bool kv_shared = REREAD || DQ;
    T* sK = kv_shared ? fa_dynamic<T, D>(4) : sQ[1];
    T* sV = kv_shared ? sK + FA_ROWS * FA_LDS(D) : sO[1];
    T* sdS = sV + FA_ROWS * FA_LDS(D);  // DQ: dS of the tile, keys × queries
    int hs = (int)hs_, warp = threadIdx.x / WARP, t = (threadIdx.x % WARP) & 3,
        w0 = warp * 16 * M;
    float sl2 = scale * LOG2E;
    i64 C = nh * hs, ldq = (nh + 2 * kvh) * hs, grp = nh / kvh,
        nkb = (Tn + FA_ROWS - 1) / FA_ROWS, ntri = nkb * (nkb + 1) / 2;
    bool vec = fa_vec_ok(qkv, hs, ldq), vec_o = fa_vec_ok(dout, hs, C);
    for (i64 item = fa_next_item<DQ>(-1, sync, &s_item); item < B * kvh * nkb;
         item = fa_next_item<DQ>(item, sync, &s_item)) {
        i64 kb = item / (B * kvh), bk = item % (B * kvh), b = bk / kvh, hk = bk % kvh;
        i64 k0 = kb * FA_ROWS;
        // The query blocks: from this key block up, or (DQ) from the last down to it.
        const i64 q_step = DQ ? -1 : 1, q_begin = DQ ? nkb - 1 : kb, q_end = DQ ? kb - 1 : nkb;
        const T* kbase = qkv + b * Tn * ldq + C + hk * hs;
        const T* vbase = kbase + kvh * hs;
        i64 q_first = q_begin * FA_ROWS;
        u32 ka[M][D / 16][4], va[M][D / 16][4];
        float dk[M][D / 8][4], dv[M][D / 8][4];
#pragma unroll
        for (int i = 0; i < M; i++) {
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
                for (int e = 0; e < 4; e++) dk[i][nd][e] = dv[i][nd][e] = 0.0f;
        }
        for (i64 h = hk * grp; h < (hk + 1) * grp; h++) {
            i64 bh = b * nh + h;
            const T* base = qkv + b * Tn * ldq + h * hs;
            const T* dob = dout + b * Tn * C + h * hs;
            const float* lse_h = lse + bh * Tn;
            const float* delta_h = delta + bh * Tn;
            bool first_head = h == hk * grp;
            __syncthreads();
            if (first_head) {
                fa_load<T, D>(sK, kbase, k0, Tn, ldq, hs, vec);  // K and V: this block's own keys
                fa_load<T, D>(sV, vbase, k0, Tn, ldq, hs, vec);
            }
            fa_load<T, D, WG>(sQ[0], base, q_first, Tn, ldq, hs, vec);  // the first query block
            fa_load<T, D, WG>(sO[0], dob, q_first, Tn, C, hs, vec_o);
            fa_load_stats(sL[0], sD[0], lse_h, delta_h, q_first, Tn);
            cp_async_wait_all();
            if constexpr (WG) wg_fence_tiles();
            __syncthreads();
            // Without kv_shared, K and V wait in buffers the query blocks then reuse: their
            // fragments are taken once, at the first head, and stay in registers.
            if constexpr (!REREAD) {
                if (first_head) {
                    fa_a_frags_m<T, M, D>(ka, sK, w0);
                    fa_a_frags_m<T, M, D>(va, sV, w0);
                }
            }
            for (i64 qb = q_begin; qb != q_end; qb += q_step) {
                int cur = (int)((qb - q_begin) * q_step & 1);
                __syncthreads();
                if (qb + q_step != q_end) {
                    i64 q1 = (qb + q_step) * FA_ROWS;
                    fa_load<T, D, WG>(sQ[cur ^ 1], base, q1, Tn, ldq, hs, vec);
                    fa_load<T, D, WG>(sO[cur ^ 1], dob, q1, Tn, C, hs, vec_o);
                    fa_load_stats(sL[cur ^ 1], sD[cur ^ 1], lse_h, delta_h, q1, Tn);
                }
                cp_async_commit();
                cp_async_wait_prior();
                if constexpr (WG) wg_fence_tiles();
                __syncthreads();
                // Transposed scores: rows are this warp's keys, columns the block's queries. P is
                // rounded to T (as the three-step path stores it) and feeds both dV and dS.
                const float *sl = sL[cur], *sd = sD[cur];
                u32 pa[M][FA_ROWS / 16][4];
                if constexpr (REREAD) fa_a_frags_m<T, M, D>(ka, sK, w0);
                {
                    float p[M][FA_ROWS / 8][4];
                    if constexpr (WG)
                        fa_wg_abt<T, D>(p[0], ka[0], sQ[cur]);
                    else
                        fa_mma_abt_m<T, M, D>(p, ka, sQ[cur]);
#pragma unroll
                    for (int i = 0; i < M; i++) {
#pragma unroll
                        for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
                            for (int e = 0; e < 4; e++)
                                p[i][n][e] =
                                    fast_exp2(fmaf(p[i][n][e], sl2, sl[n * 8 + 2 * t + (e & 1)]));
                        // On the diagonal tile a query before the key is masked: transposed,
                        // column before row.
                        if (qb == kb) fa_mask(p[i], w0 + 16 * i, 0.0f, true);
                        fa_pack<T>(pa[i], p[i]);
                    }
                }
                float ds[M][FA_ROWS / 8][4];
                if constexpr (WG) {
                    // dV += Pᵀ·dO and dPᵀ = V·dOᵀ (independent: one wait for both, the tensor
                    // cores running the second chain straight after the first).
                    if constexpr (REREAD) fa_a_frags_m<T, M, D>(va, sV, w0);
                    wg_fence();
                    fa_wg_pb_issue<T, D>(dv[0], pa[0], sO[cur]);
                    fa_wg_abt_issue<T, D>(ds[0], va[0], sO[cur]);
                    wg_commit();
                    wg_wait();
                } else {
                    fa_mma_pb_m<T, M, D>(dv, pa, sO[cur]);
                    if constexpr (REREAD) fa_a_frags_m<T, M, D>(va, sV, w0);
                    fa_mma_abt_m<T, M, D>(ds, va, sO[cur]);
                }
#pragma unroll
                for (int i = 0; i < M; i++) {
#pragma unroll
                    for (int n = 0; n < FA_ROWS / 8; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            ds[i][n][e] = fa_unpack<T>(pa[i], n, e) *
                                          (ds[i][n][e] - sd[n * 8 + 2 * t + (e & 1)]);
                    fa_pack<T>(pa[i], ds[i]);
                }
                if constexpr (DS == DS_STORE)
                    fa_put_frags_m<T, M, FA_ROWS>(
                        ds_out + (bh * ntri + qb * (qb + 1) / 2 + kb) * FA_ROWS * FA_ROWS, pa, w0);
                if constexpr (WG)
                    fa_wg_pb<T, D>(dk[0], pa[0], sQ[cur]);
                else
                    fa_mma_pb_m<T, M, D>(dk, pa, sQ[cur]);
                if constexpr (DQ) {
                    // dQ's share of this key block: dS (queries × keys) · K, the tile's
                    // query rows w0.. by this warp, over every key of the block.
                    fa_put_frags_m<T, M>(sdS, pa, w0);
                    __syncthreads();
                    fa_a_frags_trans_m<T, M>(pa, sdS, w0);
                    float dq[M][D / 8][4];
#pragma unroll
                    for (int i = 0; i < M; i++)
#pragma unroll
                        for (int nd = 0; nd < D / 8; nd++)
#pragma unroll
                            for (int e = 0; e < 4; e++) dq[i][nd][e] = 0.0f;
                    fa_mma_pb_m<T, M, D>(dq, pa, sK);
                    float* acc = dq_acc + (bh * nkb + qb) * FA_ROWS * D;
                    fa_add_dq_share<T, M, D>(acc, sync + 1 + bh * nkb + qb, dq, kb, qb,
                                          dqkv + b * Tn * ldq + h * hs, Tn, ldq, hs, scale, w0,
                                          rope);
                }
            }
        }
        float one[2] = {1.0f, 1.0f}, mul[2] = {scale, scale};
        T* dst = dqkv + b * Tn * ldq + C + hk * hs;
#pragma unroll
        for (int i = 0; i < M; i++) {
            fa_store<T, D>(dst, dk[i], k0 + w0 + 16 * i, Tn, ldq, hs, mul, rope);
            fa_store<T, D>(dst + kvh * hs, dv[i], k0 + w0 + 16 * i, Tn, ldq, hs, one);
        }
    }
}
// The dK/dV kernel's forms: heads of up to D columns, 16 or 32 keys per warp (M), each with
// dS dropped, stored or used for dQ in turn (DS), on mma.sync or (WG) wgmma; the one-kernel
// backward's also take its accumulators and counters.
#define FA_DKV(S, T, NAME, D, M, MINB, DS, WG)                                               \
    extern "C" __global__ void __launch_bounds__(FA_THREADS / (M), MINB)                     \
        NAME##_##S(T* dqkv, const float* delta, const T* dout, const float* lse,             \
                   const T* qkv, i64 B, i64 Tn, i64 nh, i64 kvh, i64 hs, float scale,        \
                   T* ds, const float* rope, i64 rope_p) {                                   \
        flash_backward_dkv_k<T, D, M, DS, WG>(dqkv, delta, dout, lse, qkv, B, Tn, nh, kvh,   \
                                              hs, scale, ds, nullptr, nullptr,               \
                                              FaRope{rope, rope_p});                         \
    }
#define FA_FUSED(S, T, NAME, M)                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS / (M), FA_MINB_FUSED)            \
        NAME##_##S(T* dqkv, const float* delta, const T* dout, const float* lse,             \
                   const T* qkv, i64 B, i64 Tn, i64 nh, i64 kvh, i64 hs, float scale,        \
                   float* dq_acc, int* sync, const float* rope, i64 rope_p) {                \
        flash_backward_dkv_k<T, 64, M, DS_TURNS>(dqkv, delta, dout, lse, qkv, B, Tn, nh, kvh, \
                                                 hs, scale, nullptr, dq_acc, sync,           \
                                                 FaRope{rope, rope_p});                      \
    }
#define DEF(S, T)                                                                            \
    FA_DKV(S, T, flash_backward_dkv, 64, 1, FA_MINB_DKV, DS_DROP, false)                     \
    FA_DKV(S, T, flash_backward_dkv_wide, 64, 2, FA_MINB_DKV_WIDE, DS_DROP, false)           \
    FA_DKV(S, T, flash_backward_dkv_store, 64, 1, FA_MINB_DKV, DS_STORE, false)              \
    FA_DKV(S, T, flash_backward_dkv_store_wide, 64, 2, FA_MINB_DKV_WIDE, DS_STORE, false)    \
    FA_DKV(S, T, flash_backward_dkv_store_wgmma, 64, 1, FA_MINB_DKV_WG, DS_STORE, true)      \
    FA_DKV(S, T, flash_backward_dkv_d128, 128, 1, FA_MINB_DKV_D128, DS_DROP, false)          \
    FA_DKV(S, T, flash_backward_dkv_store_d128, 128, 1, FA_MINB_DKV_D128, DS_STORE, false)   \
    FA_DKV(S, T, flash_backward_dkv_store_wgmma_d128, 128, 1, FA_MINB_DKV_D128, DS_STORE,     \
           true)                                                                             \
    FA_FUSED(S, T, flash_backward_fused, 1)                                                  \
    FA_FUSED(S, T, flash_backward_fused_wide, 2)
FOR_HALF_TYPES(DEF)
#undef DEF
#undef FA_FUSED
#undef FA_DKV

// Backward with stored dS (FUGU_FLASH_BACKWARD=stored), after flash_backward_prep (Δ) and
// flash_backward_dkv_store (dK, dV and the dS tiles): the Q columns of dqkv, dQ = scale ·
// Σ_kb dS_kb · K_kb over the key blocks kb ≤ qb in order, as flash_backward_dq adds them (the
// same products of the same dS values: the same bits on the emulator; on a GPU where the
// tensor cores sum a product's terms as they sum its transpose's). Five tensor-core products
// per tile pair in all instead of seven; dS is written once and read once (at T's size: for
// GPT-2 124M B=16, 214 MB per layer each way). Item = (64-row query block, sequence, head),
// the longest first; each warp M groups of 16 query rows; the K and dS tiles double-buffered.
template <typename T, int D, int M, bool WG = false>
__device__ void flash_backward_dq_stored_k(T* dqkv, const T* ds, const T* qkv, i64 B, i64 Tn,
                                           i64 nh, i64 kvh, i64 hs_, float scale, FaRope rope) {
    static_assert(!WG || (M == 1 && D % FA_WG_D == 0), "wgmma: one warpgroup of 16-row warps");
    // Key block c's tiles: K in sKS[2c] (with WG in the 128-byte swizzle), dS (keys ×
    // queries, a 64-column tile) in sKS[2c + 1].
    auto sKS = fa_tiles<T, D, 4, 0>(0);
    int hs = (int)hs_, w0 = threadIdx.x / WARP * 16 * M;
    i64 C = nh * hs, ldq = (nh + 2 * kvh) * hs, grp = nh / kvh,
        nqb = (Tn + FA_ROWS - 1) / FA_ROWS, ntri = nqb * (nqb + 1) / 2;
    const i64 tile = FA_ROWS * FA_ROWS;
    bool vec = fa_vec_ok(qkv, hs, ldq), vec_s = fa_vec_ok(ds, FA_ROWS, FA_ROWS);
    for (i64 item = blockIdx.x; item < B * nh * nqb; item += gridDim.x) {
        i64 qb = nqb - 1 - item / (B * nh), bh = item % (B * nh), b = bh / nh, h = bh % nh;
        const T* kbase = qkv + b * Tn * ldq + C + (h / grp) * hs;
        const T* dsb = ds + (bh * ntri + qb * (qb + 1) / 2) * tile;  // key block 0's tile
        __syncthreads();  // the previous item's reads are done
        fa_load<T, D, WG>(sKS[0], kbase, 0, Tn, ldq, hs, vec);
        fa_load<T, FA_ROWS>(sKS[1], dsb, 0, FA_ROWS, FA_ROWS, FA_ROWS, vec_s);
        cp_async_wait_all();
        if constexpr (WG) wg_fence_tiles();
        float dq[M][D / 8][4];
#pragma unroll
        for (int i = 0; i < M; i++)
#pragma unroll
            for (int nd = 0; nd < D / 8; nd++)
                dq[i][nd][0] = dq[i][nd][1] = dq[i][nd][2] = dq[i][nd][3] = 0.0f;
        for (i64 kb = 0; kb <= qb; kb++) {
            int cur = (int)(kb & 1);
            __syncthreads();
            if (kb < qb) {
                fa_load<T, D, WG>(sKS[2 * (cur ^ 1)], kbase, (kb + 1) * FA_ROWS, Tn, ldq, hs, vec);
                fa_load<T, FA_ROWS>(sKS[2 * (cur ^ 1) + 1], dsb + (kb + 1) * tile, 0, FA_ROWS,
                                    FA_ROWS, FA_ROWS, vec_s);
            }
            cp_async_commit();
            cp_async_wait_prior();
            if constexpr (WG) wg_fence_tiles();
            __syncthreads();
            u32 pa[M][FA_ROWS / 16][4];  // dS of this warp's query rows, keys along k
            fa_a_frags_trans_m<T, M>(pa, sKS[2 * cur + 1], w0);
            if constexpr (WG)
                fa_wg_pb<T, D>(dq[0], pa[0], sKS[2 * cur]);
            else
                fa_mma_pb_m<T, M, D>(dq, pa, sKS[2 * cur]);
        }
        float mul[2] = {scale, scale};
#pragma unroll
        for (int i = 0; i < M; i++)
            fa_store<T, D>(dqkv + b * Tn * ldq + h * hs, dq[i], qb * FA_ROWS + w0 + 16 * i, Tn, ldq,
                           hs, mul, rope);
    }
}
#define FA_DQ_STORED(S, T, NAME, D, M, MINB, WG)                                             \
    extern "C" __global__ void __launch_bounds__(FA_THREADS / (M), MINB)                     \
        NAME##_##S(T* dqkv, const T* ds, const T* qkv, i64 B, i64 Tn, i64 nh, i64 kvh,       \
                   i64 hs, float scale, const float* rope, i64 rope_p) {                     \
        flash_backward_dq_stored_k<T, D, M, WG>(dqkv, ds, qkv, B, Tn, nh, kvh, hs, scale,    \
                                                FaRope{rope, rope_p});                       \
    }
#define DEF(S, T)                                                                            \
    FA_DQ_STORED(S, T, flash_backward_dq_stored, 64, 1, FA_MINB_DQ_STORED, false)            \
    FA_DQ_STORED(S, T, flash_backward_dq_stored_wide, 64, 2, FA_MINB_DQ_STORED, false)       \
    FA_DQ_STORED(S, T, flash_backward_dq_stored_wgmma, 64, 1, FA_MINB_DQ_STORED, true)       \
    FA_DQ_STORED(S, T, flash_backward_dq_stored_d128, 128, 1, FA_MINB_DQ_STORED_D128, false)  \
    FA_DQ_STORED(S, T, flash_backward_dq_stored_wgmma_d128, 128, 1, FA_MINB_DQ_STORED_D128,   \
                 true)
FOR_HALF_TYPES(DEF)
#undef DEF
#undef FA_DQ_STORED

// The warpgroup-MMA layouts on their own (tests/cuda.rs, wgmma_layouts): d (64 × 64 f32,
// row-major) = a · bᵀ (trans = 0: b a K tile, as S = Q·Kᵀ) or a · b (trans = 1: b a V tile, as
// O = P·V), a and b 64 × 64 row-major; one block of one warpgroup. On a GPU where the flash
// kernels' wgmma results are wrong this says which operand layout is. trans = 2 (the
// emulator's check of its asynchrony, undefined on a GPU): a · bᵀ's accumulators, set to -1
// first, read between the products' issue and their wait, so d is all -1 where products take
// effect at the wait.
template <typename T>
__device__ void flash_wgmma_probe_k(float* d, const T* a, const T* b, int trans) {
    alignas(1024) __shared__ T sB[FA_ROWS * FA_WG_D];
    alignas(16) __shared__ T sA[FA_ROWS * FA_LDS(FA_WG_D)];
    fa_load<T, FA_WG_D>(sA, a, 0, FA_ROWS, FA_WG_D, FA_WG_D, true);
    fa_load<T, FA_WG_D, true>(sB, b, 0, FA_ROWS, FA_WG_D, FA_WG_D, true);
    cp_async_wait_all();
    wg_fence_tiles();
    __syncthreads();
    int w0 = threadIdx.x / WARP * 16, lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    u32 fa[FA_WG_D / 16][4];
    fa_a_frags<T, FA_WG_D>(fa, sA, w0);
    float acc[FA_ROWS / 8][4], early[FA_ROWS / 8][4];
    for (int n = 0; n < FA_ROWS / 8; n++)
        for (int e = 0; e < 4; e++) acc[n][e] = trans == 1 ? 0.0f : -1.0f;
    if (trans == 1) {
        fa_wg_pb<T>(acc, fa, sB);
    } else if (trans == 0) {
        fa_wg_abt<T>(acc, fa, sB);
    } else {
        wg_fence();
        fa_wg_abt_issue<T>(acc, fa, sB);
        for (int n = 0; n < FA_ROWS / 8; n++)
            for (int e = 0; e < 4; e++) early[n][e] = acc[n][e];
        wg_commit();
        wg_wait();
        for (int n = 0; n < FA_ROWS / 8; n++)
            for (int e = 0; e < 4; e++) acc[n][e] = early[n][e];
    }
    for (int n = 0; n < FA_ROWS / 8; n++)
        for (int e = 0; e < 4; e++)
            d[(w0 + g + (e >> 1) * 8) * FA_ROWS + n * 8 + 2 * t + (e & 1)] = acc[n][e];
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)                              \
        flash_wgmma_probe_##S(float* d, const T* a, const T* b, int trans) {                 \
        flash_wgmma_probe_k(d, a, b, trans);                                                 \
    }
FOR_HALF_TYPES(DEF)
#undef DEF

// ---- the Llama family (ops/rmsnorm.rs, ops/rope.rs, ops/swiglu.rs) -----------------------

// RMS norm forward, as layernorm_forward_k: one warp per row, the mean square in double, rows
// of up to R packs per lane from registers (LaneRow; Llama's 2048 and 4096 take the loops,
// reading the row twice, from cache the second time); out = w·(x·rstd).
template <typename T, int R>
__device__ void rmsnorm_forward_k(T* out, float* rstd, const T* inp, const T* w, i64 N, i64 C,
                                  float eps) {
    const int P = PACK(T);
    bool vec = rows_aligned(inp, C) && rows_aligned(out, C) && aligned16(w);
    i64 packs = whole_packs<T>(C, vec);
    bool cached = vec && lane_row_fits<R>(packs);
    WARP_ROWS(row, N) {
        const T* x = inp + row * C;
        T* o = out + row * C;
        LaneRow<T, R> xr;
        if (cached) lane_row_load(xr, x, packs, lane);
        double ss = 0.0;
        ln_row_each(cached, xr, x, C, vec, packs, lane, [&](i64, float v) {
            double d = (double)v;
            ss += d * d;
        });
        float rs = (float)(1.0 / sqrt(warp_sum_d(ss) / (double)C + (double)eps));
        if (cached) {
#pragma unroll
            for (int i = 0; i < R; i++) {
                i64 k = lane + (i64)i * WARP;
                if (k >= packs) continue;
                Pack<T> wp = ld_pack(w + k * P), op;
#pragma unroll
                for (int j = 0; j < P; j++) st(op.v[j], ld(wp.v[j]) * (ld(xr.p[i].v[j]) * rs));
                st_pack(o + k * P, op);
            }
        } else {
            map_elems(o, C, vec, lane, WARP, [&](i64, float v, float wc) { return wc * (v * rs); },
                      x, w);
        }
        if (lane == 0) rstd[row] = rs;
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void rmsnorm_forward_##S(T* out, float* rstd, const T* inp,        \
                                                   const T* w, i64 N, i64 C, float eps) {   \
        rmsnorm_forward_k<T, LN_LANE_PACKS>(out, rstd, inp, w, N, C, eps);                  \
    }
FOR_TYPES(DEF)
#undef DEF

// RMS norm backward, the input gradient: a block per row, dinp += rstd·(g·w − x̂·mean(g·w·x̂)),
// x̂ = x·rstd, the mean in double; by the packed loops, as layernorm_backward_dinp_k.
template <typename T>
__device__ void rmsnorm_backward_dinp_k(T* dinp, const T* dout, const T* inp, const T* w,
                                        const float* rstd, i64 N, i64 C) {
    __shared__ double sh[ROW_THREADS];
    bool vec = rows_aligned(dinp, C) && rows_aligned(dout, C) && rows_aligned(inp, C) &&
               aligned16(w);
    for (i64 row = blockIdx.x; row < N; row += gridDim.x) {
        const T* g = dout + row * C;
        const T* x = inp + row * C;
        T* d = dinp + row * C;
        float rs = rstd[row];
        double s = 0.0;
        for_each_elem<T>(C, vec, threadIdx.x, blockDim.x, [&](i64, float gc, float wc, float xc) {
            s += (double)(gc * wc * (xc * rs));
        }, g, w, x);
        float m = (float)(block_sum_d(s, sh) / (double)C);
        map_elems(d, C, vec, threadIdx.x, blockDim.x,
                  [&](i64, float dc, float gc, float wc, float xc) {
                      return dc + (gc * wc - (xc * rs) * m) * rs;
                  },
                  d, g, w, x);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void rmsnorm_backward_dinp_##S(T* dinp, const T* dout,             \
                                                         const T* inp, const T* w,          \
                                                         const float* rstd, i64 N, i64 C) { \
        rmsnorm_backward_dinp_k(dinp, dout, inp, w, rstd, N, C);                            \
    }
FOR_TYPES(DEF)
#undef DEF

// RMS norm backward, stage 1 of the weight gradient's column sums (stage 2: column_finish):
// part[k, c] = Σ over chunk k's rows of dout·x·rstd, rows in order; a thread per (chunk,
// pack of columns) where the rows are 16-byte aligned, else per (chunk, column), as
// column_partials_k (column_group's RMS form).
template <typename T>
__device__ void rmsnorm_dw_partials_k(float* part, const T* dout, const T* inp,
                                      const float* rstd, i64 N, i64 C, i64 rpc, i64 chunks) {
    bool vec = rows_aligned(dout, C) && rows_aligned(inp, C);
    i64 width = vec ? PACK(T) : 1, groups = C / width;
    GRID_STRIDE(t, stride);
    for (i64 idx = t; idx < chunks * groups; idx += stride) {
        i64 k = idx / groups, c0 = (idx % groups) * width;
        i64 r0 = k * rpc, r1 = r0 + rpc < N ? r0 + rpc : N;
        if (vec)
            column_group<PACK(T), true>(part, nullptr, dout, inp, nullptr, rstd, true, r0, r1,
                                        C, c0, k * C + c0);
        else
            column_group<1, true>(part, nullptr, dout, inp, nullptr, rstd, true, r0, r1, C, c0,
                                  k * C + c0);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void rmsnorm_dw_partials_##S(float* part, const T* dout,           \
                                                       const T* inp, const float* rstd,     \
                                                       i64 N, i64 C, i64 rpc, i64 chunks) { \
        rmsnorm_dw_partials_k(part, dout, inp, rstd, N, C, rpc, chunks);                    \
    }
FOR_TYPES(DEF)
#undef DEF

// Rotary embeddings in place (rotate_half): a thread per pack of (row, head, i < half) pairs
// (a 16-byte pack of the head's first half and the matching one of its second) where the
// rows and halves are 16-byte aligned, else per pair; `dir` +1 rotates, −1 rotates back (the
// backward). table: cos (P, half), then sin (P, half).
template <typename T>
__device__ void rope_k(T* x, const float* table, i64 N, i64 width, i64 heads, i64 half, i64 Tn,
                       i64 P, float dir) {
    const int W = PACK(T);
    bool vec = half % W == 0 && rows_aligned(x, width);
    i64 step = vec ? W : 1, per_head = half / step;
    GRID_STRIDE(t, stride);
    for (i64 idx = t; idx < N * heads * per_head; idx += stride) {
        i64 i = (idx % per_head) * step, h = (idx / per_head) % heads,
            row = idx / (per_head * heads);
        const float* cs = table + (row % Tn) * half + i;
        T* a = x + row * width + h * 2 * half + i;
        T* b = a + half;
        if (vec) {
            Pack<T> pa = ld_pack(a), pb = ld_pack(b);
#pragma unroll
            for (int e = 0; e < W; e++) {
                float x0 = ld(pa.v[e]), x1 = ld(pb.v[e]);
                rope_pair(x0, x1, cs[e], dir * cs[P * half + e]);
                st(pa.v[e], x0);
                st(pb.v[e], x1);
            }
            st_pack(a, pa);
            st_pack(b, pb);
        } else {
            float x0 = ld(*a), x1 = ld(*b);
            rope_pair(x0, x1, cs[0], dir * cs[P * half]);
            st(*a, x0);
            st(*b, x1);
        }
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void rope_##S(T* x, const float* table, i64 N, i64 width,          \
                                        i64 heads, i64 half, i64 Tn, i64 P, float dir) {    \
        rope_k(x, table, N, width, heads, half, Tn, P, dir);                                \
    }
FOR_TYPES(DEF)
#undef DEF

// SwiGLU: σ(x) and e^{−x}·σ(x) (1 − σ without the cancellation), the exponent capped at 80 as
// ops/swiglu.rs does.
__device__ void swiglu_sigmoid(float x, float& s, float& one_minus_s) {
    float z = -x;
    bool past = z > 80.0f;
    float e = expf(past ? 80.0f : z);
    s = past ? 0.0f : 1.0f / (1.0f + e);
    one_minus_s = e * s;
}
// The SwiGLU kernels' loop: f(r, j, n) for each run of n output elements (row r, columns j ..
// j + n) a thread takes: a 16-byte pack where F is whole packs and the arrays 16-byte aligned
// (one index division per pack), else one element.
template <typename T, typename Fn>
__device__ void swiglu_each(i64 N, i64 F, bool vec, Fn f) {
    i64 step = vec ? PACK(T) : 1, per_row = F / step;
    GRID_STRIDE(t, stride);
    for (i64 idx = t; idx < N * per_row; idx += stride)
        f(idx / per_row, (idx % per_row) * step, step);
}
// out (N, F) = silu(gate)·up of inp rows [gate | up] (2F).
__device__ float swiglu_elem(float g, float u) {
    float s, oms;
    swiglu_sigmoid(g, s, oms);
    return g * s * u;
}
template <typename T>
__device__ void swiglu_forward_k(T* out, const T* inp, i64 N, i64 F) {
    bool vec = F % PACK(T) == 0 && all_aligned16(out, inp);
    swiglu_each<T>(N, F, vec, [&](i64 r, i64 j, i64 n) {
        const T* g = inp + r * 2 * F + j;
        T* o = out + r * F + j;
        if (n > 1) {
            Pack<T> gp = ld_pack(g), up = ld_pack(g + F), op;
#pragma unroll
            for (int e = 0; e < PACK(T); e++)
                st(op.v[e], swiglu_elem(ld(gp.v[e]), ld(up.v[e])));
            st_pack(o, op);
        } else {
            st(*o, swiglu_elem(ld(g[0]), ld(g[F])));
        }
    });
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void swiglu_forward_##S(T* out, const T* inp, i64 N, i64 F) {      \
        swiglu_forward_k(out, inp, N, F);                                                   \
    }
FOR_TYPES(DEF)
#undef DEF

// dinp (N, 2F) = [dout·up·silu'(gate) | dout·silu(gate)], silu' = σ·(1 + x·(1 − σ)).
__device__ void swiglu_grads(float g, float u, float d, float& dg, float& du) {
    float s, oms;
    swiglu_sigmoid(g, s, oms);
    dg = d * u * (s * (1.0f + g * oms));
    du = d * (g * s);
}
template <typename T>
__device__ void swiglu_backward_k(T* dinp, const T* dout, const T* inp, i64 N, i64 F) {
    bool vec = F % PACK(T) == 0 && all_aligned16(dinp, dout, inp);
    swiglu_each<T>(N, F, vec, [&](i64 r, i64 j, i64 n) {
        const T* g = inp + r * 2 * F + j;
        const T* d = dout + r * F + j;
        T* dg = dinp + r * 2 * F + j;
        float a, b;
        if (n > 1) {
            Pack<T> gp = ld_pack(g), up = ld_pack(g + F), dp = ld_pack(d), ga, gb;
#pragma unroll
            for (int e = 0; e < PACK(T); e++) {
                swiglu_grads(ld(gp.v[e]), ld(up.v[e]), ld(dp.v[e]), a, b);
                st(ga.v[e], a);
                st(gb.v[e], b);
            }
            st_pack(dg, ga);
            st_pack(dg + F, gb);
        } else {
            swiglu_grads(ld(g[0]), ld(g[F]), ld(d[0]), a, b);
            st(dg[0], a);
            st(dg[F], b);
        }
    });
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void swiglu_backward_##S(T* dinp, const T* dout, const T* inp,     \
                                                   i64 N, i64 F) {                          \
        swiglu_backward_k(dinp, dout, inp, N, F);                                           \
    }
FOR_TYPES(DEF)
#undef DEF

// ---- pointwise (ops/gelu.rs, ops/residual.rs) -------------------------------------------

#define GELU_K 0.7978845608028654f  // sqrt(2/pi)
#define GELU_A 0.044715f

// GELU (tanh form) and its derivative, per element.
__device__ float gelu(float x) {
    float u = GELU_K * (x + GELU_A * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
__device__ float gelu_grad(float x, float d) {
    float u = GELU_K * (x + GELU_A * x * x * x);
    float th = tanhf(u);
    float sech2 = 1.0f - th * th;
    float du = GELU_K * (1.0f + (3.0f * GELU_A) * x * x);
    return d * (0.5f * (1.0f + th) + 0.5f * x * sech2 * du);
}

template <typename T>
__device__ void gelu_forward_k(T* out, const T* inp, i64 n) {
    GRID_STRIDE(t, stride);
    map_elems(out, n, all_aligned16(out, inp), t, stride, [](i64, float x) { return gelu(x); },
              inp);
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void gelu_forward_##S(T* out, const T* inp, i64 n) {               \
        gelu_forward_k(out, inp, n);                                                        \
    }
FOR_TYPES(DEF)
#undef DEF

template <typename T>
__device__ void gelu_backward_k(T* dinp, const T* inp, const T* dout, i64 n) {
    GRID_STRIDE(t, stride);
    map_elems(dinp, n, all_aligned16(dinp, inp, dout), t, stride,
              [](i64, float x, float d) { return gelu_grad(x, d); }, inp, dout);
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void gelu_backward_##S(T* dinp, const T* inp, const T* dout,       \
                                                 i64 n) {                                   \
        gelu_backward_k(dinp, inp, dout, n);                                                \
    }
FOR_TYPES(DEF)
#undef DEF

template <typename T>
__device__ void residual_forward_k(T* out, const T* a, const T* b, i64 n) {
    GRID_STRIDE(t, stride);
    map_elems(out, n, all_aligned16(out, a, b), t, stride,
              [](i64, float x, float y) { return x + y; }, a, b);
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void residual_forward_##S(T* out, const T* a, const T* b, i64 n) { \
        residual_forward_k(out, a, b, n);                                                   \
    }
FOR_TYPES(DEF)
#undef DEF

template <typename T>
__device__ void add_inplace_k(T* acc, const T* x, i64 n) {
    GRID_STRIDE(t, stride);
    map_elems(acc, n, all_aligned16(acc, x), t, stride,
              [](i64, float s, float y) { return s + y; }, acc, x);
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void add_inplace_##S(T* acc, const T* x, i64 n) {                  \
        add_inplace_k(acc, x, n);                                                           \
    }
FOR_TYPES(DEF)
#undef DEF

// x *= factor, rounded once: data parallelism's gradient average (CUDA-aware collectives).
template <typename T>
__device__ void scale_inplace_k(T* x, float factor, i64 n) {
    GRID_STRIDE(t, stride);
    map_elems(x, n, aligned16(x), t, stride,
              [factor](i64, float v) { return v * factor; }, x);
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void scale_inplace_##S(T* x, float factor, i64 n) {                \
        scale_inplace_k(x, factor, n);                                                      \
    }
FOR_TYPES(DEF)
#undef DEF

// dst (T) = src (float), rounded: the master → compute-copy refresh of mixed precision.
template <typename T>
__device__ void convert_k(T* dst, const float* src, i64 n) {
    const int P = PACK(T);
    i64 packs = whole_packs<T>(n, aligned16(dst) && aligned16(src));
    GRID_STRIDE(t, stride);
    for (i64 k = t; k < packs; k += stride) {
        Pack<T> o;
        for (int q = 0; q < P; q += PACK(float)) {
            Pack<float> x = ld_pack(src + k * P + q);
            for (int j = 0; j < PACK(float); j++) st(o.v[q + j], x.v[j]);
        }
        st_pack(dst + k * P, o);
    }
    for (i64 i = packs * P + t; i < n; i += stride) st(dst[i], src[i]);
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void convert_##S(T* dst, const float* src, i64 n) {                \
        convert_k(dst, src, n);                                                             \
    }
FOR_TYPES(DEF)
#undef DEF

// ---- cross-entropy phases (ops/crossentropy.rs); T is the logits' type --------------------

// A row's statistics in one pass (ce_stats_row: the block's; every thread gets them;
// ce_row_stats: this shard's, into maxes[r] and sums[r] = Σ exp(x - maxes[r])), the sum in
// double. Each thread keeps a running maximum m and its sum relative to m, scaled down
// when m grows (rarely, after the first elements); the block then takes the maximum M of the
// threads' and adds their sums scaled by exp(m - M), in a fixed tree. A thread adds its
// exponentials in float, PACK(T) at a time (at most 8 terms of at most 1 each: within 8
// float roundings), and each group's sum into its double: one conversion to double per group
// instead of per element (conversions to double run at a quarter of the exponential's rate
// or less; 824M logits per GPT-2 124M B=16 step).
template <typename T>
__device__ void ce_stats_row(float& mx, double& sum, const T* row, bool aligned, i64 V,
                             float* shf, double* sh) {
    float m = NEG_INF, g = 0.0f;  // g: the group's sum, relative to m
    double s = 0.0;
    int terms = 0;
    for_each_elem<T>(V, aligned, threadIdx.x, blockDim.x,
                     [&](i64, float x) {
                         if (x > m) {
                             float scale = expf(m - x);  // 0 · 0 from m = −∞
                             s *= (double)scale;
                             g *= scale;
                             m = x;
                         }
                         if (m != NEG_INF) g += expf(x - m);
                         if (++terms == PACK(T)) {
                             s += (double)g;
                             g = 0.0f;
                             terms = 0;
                         }
                     },
                     row);
    s += (double)g;
    mx = block_max_f(m, shf);
    sum = block_sum_d(m == NEG_INF ? 0.0 : s * (double)expf(m - mx), sh);
}

template <typename T>
__device__ void ce_row_stats_k(float* maxes, float* sums, const T* logits, i64 N, i64 VP,
                               i64 V) {
    __shared__ float shf[ROW_THREADS];
    __shared__ double sh[ROW_THREADS];
    bool aligned = rows_aligned(logits, VP);
    for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
        float mx;
        double s;
        ce_stats_row(mx, s, logits + r * VP, aligned, V, shf, sh);
        if (threadIdx.x == 0) {
            maxes[r] = mx;
            sums[r] = (float)s;
        }
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void ce_row_stats_##S(float* maxes, float* sums, const T* logits,  \
                                                i64 N, i64 VP, i64 V) {                     \
        ce_row_stats_k(maxes, sums, logits, N, VP, V);                                      \
    }
FOR_TYPES(DEF)
#undef DEF

// sums[i] from the local maxima to the all-reduced ones (ops/crossentropy.rs, rescaled).
__device__ void ce_rescale_sums_k(float* sums, const float* local, const float* maxes, i64 n) {
    GRID_STRIDE(i, stride);
    for (; i < n; i += stride) {
        float l = local[i], m = maxes[i];
        if (l != m) sums[i] = l == NEG_INF ? 0.0f : sums[i] * expf(l - m);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void ce_rescale_sums_##S(float* sums, const float* local,          \
                                                   const float* maxes, i64 n) {             \
        ce_rescale_sums_k(sums, local, maxes, n);                                           \
    }
FOR_TYPES(DEF)
#undef DEF

template <typename T>
__device__ void ce_target_logit_k(float* tl, const T* logits, const u32* targets,
                                  i64 vocab_start, i64 N, i64 VP, i64 V) {
    for (i64 r = blockIdx.x * (i64)blockDim.x + threadIdx.x; r < N;
         r += (i64)gridDim.x * blockDim.x) {
        i64 j = (i64)targets[r] - vocab_start;
        tl[r] = (j >= 0 && j < V) ? ld(logits[r * VP + j]) : 0.0f;
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void ce_target_logit_##S(float* tl, const T* logits,               \
                                                   const u32* targets, i64 vocab_start,     \
                                                   i64 N, i64 VP, i64 V) {                  \
        ce_target_logit_k(tl, logits, targets, vocab_start, N, VP, V);                      \
    }
FOR_TYPES(DEF)
#undef DEF

// One row's loss into *loss (thread 0) from its statistics (max m, sum s, target logit t), and
// with `has_grad` the row overwritten by dloss·(softmax - onehot) (padding 0; tj the target's
// column in this shard, or outside 0..V); without it, the loss as the CPU backend's
// evaluation path computes it (in float). ce_finish and ce_fused.
template <typename T>
__device__ void ce_finish_row(float* loss, T* row, float m, float s, float t, i64 tj, float dloss,
                              int has_grad, bool aligned, i64 VP, i64 V) {
    if (threadIdx.x == 0)
        *loss = has_grad ? (float)(log((double)s) + (double)m - (double)t) : logf(s) + m - t;
    if (!has_grad) return;
    float inv = 1.0f / s;
    float k = dloss * inv;
    auto grad = [&](i64 j, float x) {
        if (j >= V) return 0.0f;
        if (j == tj) return dloss * (expf(x - m) * inv - 1.0f);
        return expf(x - m) * k;
    };
    map_elems(row, VP, aligned, threadIdx.x, blockDim.x, grad, row);
}

// Phase 4: every row's loss and, with `has_grad`, gradient (ce_finish_row) from the
// all-reduced statistics.
template <typename T>
__device__ void ce_finish_k(float* losses, T* logits, const float* maxes, const float* sums,
                            const float* tl, const u32* targets, i64 vocab_start, float dloss,
                            int has_grad, i64 N, i64 VP, i64 V) {
    bool aligned = rows_aligned(logits, VP);
    for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
        i64 tj = (i64)targets[r] - vocab_start;
        ce_finish_row(losses + r, logits + r * VP, maxes[r], sums[r], tl[r], tj, dloss, has_grad,
                      aligned, VP, V);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void ce_finish_##S(float* losses, T* logits, const float* maxes,   \
                                             const float* sums, const float* tl,            \
                                             const u32* targets, i64 vocab_start,           \
                                             float dloss, int has_grad, i64 N, i64 VP,      \
                                             i64 V) {                                       \
        ce_finish_k(losses, logits, maxes, sums, tl, targets, vocab_start, dloss, has_grad, \
                    N, VP, V);                                                              \
    }
FOR_TYPES(DEF)
#undef DEF

// The phases for one shard in one kernel (Backend::ce_whole_vocab, FUGU_CROSS_ENTROPY=fused):
// a row's statistics, target logit, loss and, with `has_grad`, gradient, its block rereading the row
// for the gradient straight after reading it for the statistics, from L2 if it is still there
// (ptxas, sm_90: 46-48 registers, 5 blocks per SM: 660 rows of GPT-2's 100 KB in flight
// against an L2 of 50-60 MB; the A/B measures whether it is), the logits then read from HBM
// once.
// The same code as ce_row_stats, ce_target_logit and ce_finish: the same bits.
template <typename T>
__device__ void ce_fused_k(float* losses, T* logits, float* maxes, float* sums, float* tl,
                           const u32* targets, i64 vocab_start, float dloss, int has_grad,
                           i64 N, i64 VP, i64 V) {
    __shared__ float shf[ROW_THREADS];
    __shared__ double sh[ROW_THREADS];
    bool aligned = rows_aligned(logits, VP);
    for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
        T* row = logits + r * VP;
        i64 tj = (i64)targets[r] - vocab_start;  // vocab_start: 0, ce_finish's arguments
        // Read before the statistics' reductions, whose barriers come before any write.
        float t = (tj >= 0 && tj < V) ? ld(row[tj]) : 0.0f;
        float m;
        double sd;
        ce_stats_row(m, sd, row, aligned, V, shf, sh);
        float s = (float)sd;
        if (threadIdx.x == 0) {
            maxes[r] = m;
            sums[r] = s;
            tl[r] = t;
        }
        ce_finish_row(losses + r, row, m, s, t, tj, dloss, has_grad, aligned, VP, V);
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void ce_fused_##S(float* losses, T* logits, float* maxes,          \
                                            float* sums, float* tl, const u32* targets,     \
                                            i64 vocab_start, float dloss, int has_grad,     \
                                            i64 N, i64 VP, i64 V) {                         \
        ce_fused_k(losses, logits, maxes, sums, tl, targets, vocab_start, dloss, has_grad,  \
                   N, VP, V);                                                               \
    }
FOR_TYPES(DEF)
#undef DEF

// ---- optimizer (ops/adamw.rs) ---------------------------------------------------------------
//
// Both kernels work on many tensors in one launch (a GPT-2 step has one per parameter tensor:
// 148 for the 124M model, most of them a few thousand elements). The host describes the
// tensors in a table of `words` i64s per part, the part's first virtual block in its last
// word; virtual blocks are numbered across the parts, and each block of the grid runs the
// virtual blocks blockIdx.x, blockIdx.x + gridDim.x, ... (the launch's grid is capped).

// The part that virtual block `vb` belongs to: the last whose first virtual block is at most
// `vb` (parts without virtual blocks share their successor's first and are never chosen).
__device__ const i64* part_of(const i64* table, int words, int parts, i64 vb) {
    int lo = 0, hi = parts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (table[mid * words + words - 1] <= vb) lo = mid;
        else hi = mid - 1;
    }
    return table + lo * words;
}

// Elements per virtual block of the AdamW kernel (ADAMW_CHUNK in mod.rs): contiguous, so a
// block reads coalesced runs, and long enough that finding the part costs nothing.
#define ADAMW_CHUNK 4096
#define ADAMW_WORDS 8

// One AdamW step in PyTorch's order on float parameters, gradients and moments; the per-step
// scalars are computed on the host exactly as the CPU op computes them. With T bf16 or f16,
// each updated parameter is also rounded into the compute copy (what `convert` would write,
// without reading the parameters again). Table row per part: params, grads, m, v (addresses),
// n, whether decayed (1: p *= decay, 0: p unchanged), the compute copy (address; unused for
// f32), first virtual block (ADAMW_CHUNK elements each).
template <typename T>
__device__ void adamw_k(const i64* table, int parts, i64 vblocks, float beta1, float beta2,
                        float eps, float scale, float one_m_b1, float one_m_b2,
                        float neg_step_size, float bc2_sqrt, float decay) {
    constexpr bool copy = sizeof(T) == 2;
    for (i64 vb = blockIdx.x; vb < vblocks; vb += gridDim.x) {
        const i64* row = part_of(table, ADAMW_WORDS, parts, vb);
        float* p = (float*)row[0];
        const float* g = (const float*)row[1];
        float *m = (float*)row[2], *v = (float*)row[3];
        T* c = (T*)row[6];
        i64 n = row[4], start = (vb - row[7]) * ADAMW_CHUNK;
        i64 end = n < start + ADAMW_CHUNK ? n : start + ADAMW_CHUNK;
        float dec = row[5] ? decay : 1.0f;
        for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
            float gi = ld(g[i]) * scale;
            float pi = p[i] * dec;
            float mi = beta1 * m[i] + one_m_b1 * gi;
            float vi = beta2 * v[i] + one_m_b2 * gi * gi;
            float denom = sqrtf(vi) / bc2_sqrt + eps;
            float updated = pi + neg_step_size * mi / denom;
            p[i] = updated;
            m[i] = mi;
            v[i] = vi;
            if constexpr (copy) st(c[i], updated);
        }
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void adamw_##S(const i64* table, int parts, i64 vblocks,           \
                                         float beta1, float beta2, float eps, float scale,  \
                                         float one_m_b1, float one_m_b2,                    \
                                         float neg_step_size, float bc2_sqrt, float decay) { \
        adamw_k<T>(table, parts, vblocks, beta1, beta2, eps, scale, one_m_b1, one_m_b2,     \
                   neg_step_size, bc2_sqrt, decay);                                         \
    }
FOR_TYPES(DEF)
#undef DEF

#define SOS_WORDS 4

// Partial Σ x² in double. Table row per span: x (address), n, the span's number of virtual
// blocks nb (fixed by the host from n alone), its first virtual block. Virtual block j of a
// span sums the grid-stride share j, j + nb, ... (in units of blockDim elements) into
// partials[its number]; the host adds each span's partials in order.
template <typename T>
__device__ void sum_of_squares_k(double* partials, const i64* table, int spans, i64 vblocks) {
    __shared__ double sh[ROW_THREADS];
    for (i64 vb = blockIdx.x; vb < vblocks; vb += gridDim.x) {
        const i64* row = part_of(table, SOS_WORDS, spans, vb);
        const T* x = (const T*)row[0];
        i64 n = row[1], nb = row[2];
        double s = 0.0;
        for (i64 i = (vb - row[3]) * blockDim.x + threadIdx.x; i < n; i += nb * blockDim.x) {
            double d = (double)ld(x[i]);
            s += d * d;
        }
        s = block_sum_d(s, sh);
        if (threadIdx.x == 0) partials[vb] = s;
    }
}
#define DEF(S, T)                                                                            \
    extern "C" __global__ void sum_of_squares_##S(double* partials, const i64* table,        \
                                                  int spans, i64 vblocks) {                 \
        sum_of_squares_k<T>(partials, table, spans, vblocks);                               \
    }
FOR_TYPES(DEF)
#undef DEF
