// fugu's CUDA kernels: every Backend op that is not a GEMM (the GEMMs go to cuBLAS).
//
// Compiled at run time by NVRTC (src/backend/cuda/mod.rs), with --fmad=false so that no
// multiply-add is contracted into an FMA the CPU reference does not use. The semantics of each
// kernel are those of the CPU op it names in src/ops/ (shapes, overwrite vs +=); the comments
// here say only how the work is split.
//
// Determinism: no atomics. Every reduction has a fixed shape (fixed block size, fixed tree,
// fixed chunking of rows), so a run is bit-reproducible on the same GPU. Statistics that the
// CPU accumulates in f64 (layernorm mean/variance and its backward row sums, softmax and
// cross-entropy sums of exponentials, sum of squares) are accumulated in double here too.
//
// Launch shapes are chosen by the host: "row" kernels use one block of ROW_THREADS threads per
// row (a grid-stride loop over rows), elementwise kernels a grid-stride loop over elements.

#define ROW_THREADS 256

// Dynamic shared memory (the host emulator, src/backend/cuda/emu_shim.h, defines its own).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#endif
#define NEG_INF __int_as_float(0xff800000)

typedef unsigned int u32;
typedef long long i64;

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

// ---- embedding (ops/encoder.rs) ---------------------------------------------------------

// out (N, C) = wte[tok - vocab_start] (0 outside the shard's `rows` rows) + wpe[i % T].
extern "C" __global__ void encoder_forward(float* out, const u32* tok, const float* wte,
                                           const float* wpe, int has_wpe, i64 vocab_start,
                                           i64 rows, i64 T, i64 C, i64 N) {
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < N * C;
         idx += (i64)gridDim.x * blockDim.x) {
        i64 i = idx / C, c = idx % C;
        i64 r = (i64)tok[i] - vocab_start;
        float v = (r >= 0 && r < rows) ? wte[r * C + c] : 0.0f;
        if (has_wpe) v += wpe[(i % T) * C + c];
        out[idx] = v;
    }
}

// dwte[row] += dout[p] for the positions p of each row, in increasing p (the host buckets the
// positions by row: rows[u], positions pos[start[u] .. start[u+1]]). One block per bucket,
// threads over C.
extern "C" __global__ void encoder_backward_wte(float* dwte, const float* dout, const int* rows,
                                                const int* start, const int* pos, int buckets,
                                                i64 C) {
    for (int u = blockIdx.x; u < buckets; u += gridDim.x) {
        i64 r = rows[u];
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = dwte[r * C + c];
            for (int k = start[u]; k < start[u + 1]; k++) acc += dout[(i64)pos[k] * C + c];
            dwte[r * C + c] = acc;
        }
    }
}

// dwpe[t] += Σ_b dout[b, t], b in order. One thread per (t, c).
extern "C" __global__ void encoder_backward_wpe(float* dwpe, const float* dout, i64 B, i64 T,
                                                i64 C) {
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < T * C;
         idx += (i64)gridDim.x * blockDim.x) {
        float acc = dwpe[idx];
        for (i64 b = 0; b < B; b++) acc += dout[b * T * C + idx];
        dwpe[idx] = acc;
    }
}

// ---- layernorm (ops/layernorm.rs) -------------------------------------------------------

extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd,
                                             const float* inp, const float* w, const float* b,
                                             i64 N, i64 C) {
    __shared__ double sh[ROW_THREADS];
    for (i64 row = blockIdx.x; row < N; row += gridDim.x) {
        const float* x = inp + row * C;
        double s = 0.0;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) s += (double)x[c];
        double mu = block_sum_d(s, sh) / (double)C;
        double ss = 0.0;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            double d = (double)x[c] - mu;
            ss += d * d;
        }
        double var = block_sum_d(ss, sh) / (double)C;
        float m = (float)mu;
        float rs = (float)(1.0 / sqrt(var + 1e-5));
        if (threadIdx.x == 0) {
            mean[row] = m;
            rstd[row] = rs;
        }
        float* o = out + row * C;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) o[c] = (x[c] - m) * rs * w[c] + b[c];
    }
}

// dinp += rstd·(g - mean(g) - x̂·mean(g·x̂)) per row, g = dout·w, the row means in double.
extern "C" __global__ void layernorm_backward_dinp(float* dinp, const float* dout,
                                                   const float* inp, const float* w,
                                                   const float* mean, const float* rstd, i64 N,
                                                   i64 C) {
    __shared__ double sh[ROW_THREADS];
    for (i64 row = blockIdx.x; row < N; row += gridDim.x) {
        const float* g = dout + row * C;
        const float* x = inp + row * C;
        float mu = mean[row], rs = rstd[row];
        double s1 = 0.0, s2 = 0.0;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            float xhat = (x[c] - mu) * rs;
            float dn = g[c] * w[c];
            s1 += (double)dn;
            s2 += (double)(dn * xhat);
        }
        float m1 = (float)(block_sum_d(s1, sh) / (double)C);
        float m2 = (float)(block_sum_d(s2, sh) / (double)C);
        float* d = dinp + row * C;
        for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
            float xhat = (x[c] - mu) * rs;
            d[c] += (g[c] * w[c] - m1 - xhat * m2) * rs;
        }
    }
}

// Column sums in two fixed stages. Stage 1: part[k, c] = Σ rows of chunk k (rows k·rpc ..),
// in row order. With `inp` (layernorm), also part2[k, c] = Σ dout·x̂. One thread per (k, c).
extern "C" __global__ void column_partials(float* part, float* part2, const float* dout,
                                           const float* inp, const float* mean,
                                           const float* rstd, int with_xhat, i64 N, i64 C,
                                           i64 rpc, i64 chunks) {
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < chunks * C;
         idx += (i64)gridDim.x * blockDim.x) {
        i64 k = idx / C, c = idx % C;
        i64 r0 = k * rpc, r1 = r0 + rpc < N ? r0 + rpc : N;
        float s = 0.0f, s2 = 0.0f;
        for (i64 r = r0; r < r1; r++) {
            float g = dout[r * C + c];
            s += g;
            if (with_xhat) s2 += g * ((inp[r * C + c] - mean[r]) * rstd[r]);
        }
        part[idx] = s;
        if (with_xhat) part2[idx] = s2;
    }
}

// Stage 2: dst[c] += Σ_k part[k, c], k in order. One thread per column.
extern "C" __global__ void column_finish(float* dst, const float* part, i64 C, i64 chunks) {
    for (i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x; c < C;
         c += (i64)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (i64 k = 0; k < chunks; k++) s += part[k * C + c];
        dst[c] += s;
    }
}

// out[i, j] = bias[j] (the GEMM then adds with beta = 1; ops/linear.rs).
extern "C" __global__ void broadcast_rows(float* out, const float* bias, i64 N, i64 C) {
    for (i64 idx = blockIdx.x * (i64)blockDim.x + threadIdx.x; idx < N * C;
         idx += (i64)gridDim.x * blockDim.x)
        out[idx] = bias[idx % C];
}

// ---- attention (ops/attention.rs) -------------------------------------------------------

// Causal softmax in place on rows of T; row r is query i = r % T: columns 0..=i become the
// softmax (max-subtracted, sum of exponentials in double), columns > i exactly 0.
extern "C" __global__ void attention_softmax(float* att, i64 rows, i64 T) {
    __shared__ double sh[ROW_THREADS];
    __shared__ float shf[ROW_THREADS];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* a = att + r * T;
        i64 i = r % T;
        float mx = NEG_INF;
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x) mx = fmaxf(mx, a[j]);
        mx = block_max_f(mx, shf);
        double s = 0.0;
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x) s += (double)expf(a[j] - mx);
        float scale = (float)(1.0 / block_sum_d(s, sh));
        for (i64 j = threadIdx.x; j < T; j += blockDim.x)
            a[j] = j <= i ? expf(a[j] - mx) * scale : 0.0f;
    }
}

// datt = att·(datt - Σ_{k≤i} datt·att) on columns ≤ i, 0 above; in place, one block per row.
extern "C" __global__ void attention_softmax_backward(float* datt, const float* att, i64 rows,
                                                      i64 T) {
    __shared__ double sh[ROW_THREADS];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float* d = datt + r * T;
        const float* a = att + r * T;
        i64 i = r % T;
        double s = 0.0;
        for (i64 j = threadIdx.x; j <= i; j += blockDim.x) s += (double)(d[j] * a[j]);
        float sf = (float)block_sum_d(s, sh);
        for (i64 j = threadIdx.x; j < T; j += blockDim.x) d[j] = j <= i ? a[j] * (d[j] - sf) : 0.0f;
    }
}

// One new token over the cache: block h computes head h. Scores go to dynamic shared memory
// (len floats), then softmax, then each thread one output element of the head.
extern "C" __global__ void attention_decode(float* out, const float* q, const float* kc,
                                            const float* vc, i64 len, i64 nh, i64 hs,
                                            float scale) {
    DYNAMIC_SHARED(float, w);
    __shared__ double sh[ROW_THREADS];
    __shared__ float shf[ROW_THREADS];
    i64 c = nh * hs;
    for (i64 h = blockIdx.x; h < nh; h += gridDim.x) {
        const float* qh = q + h * hs;
        float mx = NEG_INF;
        for (i64 s = threadIdx.x; s < len; s += blockDim.x) {
            const float* k = kc + s * c + h * hs;
            float acc = 0.0f;
            for (i64 d = 0; d < hs; d++) acc += qh[d] * k[d];
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
            for (i64 s = 0; s < len; s++) acc += w[s] * vc[s * c + h * hs + d];
            out[h * hs + d] = acc;
        }
        __syncthreads();
    }
}

// ---- pointwise (ops/gelu.rs, ops/residual.rs) -------------------------------------------

#define GELU_K 0.7978845608028654f  // sqrt(2/pi)
#define GELU_A 0.044715f

extern "C" __global__ void gelu_forward(float* out, const float* inp, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_A * x * x * x);
        out[i] = 0.5f * x * (1.0f + tanhf(u));
    }
}

extern "C" __global__ void gelu_backward(float* dinp, const float* inp, const float* dout,
                                         i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        float x = inp[i];
        float u = GELU_K * (x + GELU_A * x * x * x);
        float th = tanhf(u);
        float sech2 = 1.0f - th * th;
        float du = GELU_K * (1.0f + (3.0f * GELU_A) * x * x);
        dinp[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * sech2 * du);
    }
}

extern "C" __global__ void residual_forward(float* out, const float* a, const float* b, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x)
        out[i] = a[i] + b[i];
}

extern "C" __global__ void add_inplace(float* acc, const float* x, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x)
        acc[i] += x[i];
}

// ---- cross-entropy phases (ops/crossentropy.rs) -----------------------------------------

extern "C" __global__ void ce_row_max(float* maxes, const float* logits, i64 N, i64 VP,
                                      i64 V) {
    __shared__ float shf[ROW_THREADS];
    for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
        float mx = NEG_INF;
        for (i64 j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, logits[r * VP + j]);
        mx = block_max_f(mx, shf);
        if (threadIdx.x == 0) maxes[r] = mx;
    }
}

extern "C" __global__ void ce_row_sumexp(float* sums, const float* logits, const float* maxes,
                                         i64 N, i64 VP, i64 V) {
    __shared__ double sh[ROW_THREADS];
    for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
        float m = maxes[r];
        double s = 0.0;
        for (i64 j = threadIdx.x; j < V; j += blockDim.x)
            s += (double)expf(logits[r * VP + j] - m);
        s = block_sum_d(s, sh);
        if (threadIdx.x == 0) sums[r] = (float)s;
    }
}

extern "C" __global__ void ce_target_logit(float* tl, const float* logits, const u32* targets,
                                           i64 vocab_start, i64 N, i64 VP, i64 V) {
    for (i64 r = blockIdx.x * (i64)blockDim.x + threadIdx.x; r < N;
         r += (i64)gridDim.x * blockDim.x) {
        i64 j = (i64)targets[r] - vocab_start;
        tl[r] = (j >= 0 && j < V) ? logits[r * VP + j] : 0.0f;
    }
}

// Losses; with `has_grad`, the logits overwritten by dloss·(softmax - onehot) (padding 0).
// Without it, the loss as the CPU backend's evaluation path computes it (in float).
extern "C" __global__ void ce_finish(float* losses, float* logits, const float* maxes,
                                     const float* sums, const float* tl, const u32* targets,
                                     i64 vocab_start, float dloss, int has_grad, i64 N, i64 VP,
                                     i64 V) {
    for (i64 r = blockIdx.x; r < N; r += gridDim.x) {
        float m = maxes[r], s = sums[r];
        if (threadIdx.x == 0)
            losses[r] = has_grad ? (float)(log((double)s) + (double)m - (double)tl[r])
                                 : logf(s) + m - tl[r];
        if (!has_grad) continue;
        float inv = 1.0f / s;
        float k = dloss * inv;
        i64 tj = (i64)targets[r] - vocab_start;
        float* row = logits + r * VP;
        for (i64 j = threadIdx.x; j < VP; j += blockDim.x) {
            if (j >= V) {
                row[j] = 0.0f;
            } else if (j == tj) {
                row[j] = dloss * (expf(row[j] - m) * inv - 1.0f);
            } else {
                row[j] = expf(row[j] - m) * k;
            }
        }
    }
}

// ---- optimizer (ops/adamw.rs) -----------------------------------------------------------

// One AdamW step in PyTorch's order; the per-step scalars are computed on the host exactly as
// the CPU op computes them.
extern "C" __global__ void adamw(float* p, const float* g, float* m, float* v, i64 n,
                                 float beta1, float beta2, float eps, float scale,
                                 float one_m_b1, float one_m_b2, float neg_step_size,
                                 float bc2_sqrt, float decay) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        float gi = g[i] * scale;
        float pi = p[i] * decay;
        float mi = beta1 * m[i] + one_m_b1 * gi;
        float vi = beta2 * v[i] + one_m_b2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        p[i] = pi + neg_step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
    }
}

// Partial Σ x² in double: block b sums a fixed grid-stride share (the grid size is fixed by
// the host), partials[b] written; the host adds the partials in order.
extern "C" __global__ void sum_of_squares(double* partials, const float* x, i64 n) {
    __shared__ double sh[ROW_THREADS];
    double s = 0.0;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n;
         i += (i64)gridDim.x * blockDim.x) {
        double d = (double)x[i];
        s += d * d;
    }
    s = block_sum_d(s, sh);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
