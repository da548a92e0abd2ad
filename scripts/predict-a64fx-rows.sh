#!/usr/bin/env bash
# Predicts A64FX cycles per element of the non-GEMM row kernels with llvm-mca, three ways:
#   a64fx:   fugu's portable loops compiled with -C target-cpu=a64fx (512-bit SVE)
#   generic: the same loops for the default aarch64 target (128-bit NEON)
#   sve-asm: the hand-written SVE kernels of fugu-rows (rows/src/sve.rs), which fugu runs on
#            every CPU with SVE whatever the build (ops::row_isa)
#
#   scripts/predict-a64fx-rows.sh
#
# For each kernel (the `dispatch_rows!` functions of src/ops: the cross-entropy's
# exponentials, the softmax's one-pass exp-and-sum and its scale, the attention softmax
# backward, GELU forward and backward, the layernorm rows,
# the AdamW update, the sum of squares of the gradient norm) the script disassembles the
# release rlibs, takes the innermost
# loops with vector floating-point instructions, runs each through
#   llvm-mca-14 -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations=300 loop.s
# and adds up cycles per iteration / elements per iteration (vector loads per streamed array x
# lanes: 16 f32 per SVE z register on A64FX, 8 where f32 are loaded into 64-bit lanes, 4 per
# NEON q register; `ldp q` counts two).
# Compute only: HBM bandwidth (256 GB/s per CMG) is not in llvm-mca's model. Output: a table,
# target/aarch64-rows/rows.tsv, and the predicted non-GEMM share of a GPT-2 124M step on one
# A64FX CMG for each of the three (each op the larger of its compute and its HBM time), in
# fp32 and in fp16 (16-bit activations: half the bytes; GEMMs at the f16 kernel's rate).
# Release builds for aarch64 with Debian's rustc as in scripts/test-aarch64.sh (two target
# directories, several minutes each the first time).
set -euo pipefail

cd "$(dirname "$0")/.."

die() {
    echo "predict-a64fx-rows.sh: $*" >&2
    exit 1
}

OBJDUMP="${LLVM_OBJDUMP:-llvm-objdump-14}"
MCA="${LLVM_MCA:-llvm-mca-14}"
OUT="${FUGU_MCA_OUT:-target/aarch64-rows}"
[[ -x /usr/bin/rustc ]] || die "/usr/bin/rustc (Debian rustc-web) is missing; run scripts/install-deps.sh"
command -v aarch64-linux-gnu-gcc >/dev/null || die "aarch64-linux-gnu-gcc is missing; run scripts/install-deps.sh"
command -v "$OBJDUMP" >/dev/null || die "$OBJDUMP is missing (llvm-14); run scripts/install-deps.sh"
command -v "$MCA" >/dev/null || die "$MCA is missing (llvm-14); run scripts/install-deps.sh"

TARGET=aarch64-unknown-linux-gnu
export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
mkdir -p "$OUT"

build() { # name target-dir rustflags
    local name=$1 dir=$2 flags=$3
    echo "== release build of fugu for $TARGET ($name: RUSTFLAGS='$flags')" >&2
    CARGO_TARGET_DIR="$dir" CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="$flags" \
        cargo build --release -p fugu --lib --target "$TARGET" >&2
    local rlib="$dir/$TARGET/release/libfugu.rlib"
    [[ -f "$rlib" ]] || die "$rlib not found after the build"
    "$OBJDUMP" -d --no-show-raw-insn --mattr=+sve --demangle "$rlib" >"$OUT/$name.dis" 2>/dev/null || true
    [[ -s "$OUT/$name.dis" ]] || die "$OBJDUMP produced no disassembly of $rlib"
}
build a64fx target/aarch64-a64fx "-C target-feature=+crt-static -C target-cpu=a64fx"
build generic target/aarch64 "-C target-feature=+crt-static"
# A dependency's rlib stays in deps/ (the newest one is this build's).
rows_rlib=$(ls -t target/aarch64/$TARGET/release/deps/libfugu_rows-*.rlib 2>/dev/null | head -1)
[[ -n "$rows_rlib" ]] || die "no libfugu_rows rlib in target/aarch64/$TARGET/release/deps after the build"
"$OBJDUMP" -d --no-show-raw-insn --mattr=+sve --demangle "$rows_rlib" >"$OUT/sve-asm.dis" 2>/dev/null || true
[[ -s "$OUT/sve-asm.dis" ]] || die "$OBJDUMP produced no disassembly of $rows_rlib"

python3 - "$OUT" "$MCA" <<'PY'
import os
import re
import subprocess
import sys

out, mca = sys.argv[1], sys.argv[2]
# kernel symbol (module::function), passes over the data, what it is, and the fugu-rows
# kernels (one loop each) that do the same on SVE.
KERNELS = [
    ("fastmath::sum_exp_f32", 1, "cross-entropy: sum of exp(x - max)", ["sve::sum_exp"]),
    ("fastmath::exp_scale_f32", 1, "cross-entropy: scale·exp(x - max), in place", ["sve::exp_scale"]),
    ("fastmath::exp_sum_f32", 1, "softmax: exp(x - max) in place, and their sum", ["sve::exp_sum"]),
    ("fastmath::scale_f32", 1, "softmax: row·scale, in place", ["sve::scale_row"]),
    ("attention::softmax_backward_row_f32", 2, "attention softmax backward row (sum, update)",
     ["sve::dot", "sve::softmax_backward_update"]),
    ("gelu::gelu_rows_f32", 1, "GELU forward", ["sve::gelu"]),
    ("gelu::gelu_backward_rows_f32", 1, "GELU backward", ["sve::gelu_backward"]),
    ("layernorm::layernorm_row_f32", 3, "layernorm forward row (mean, variance, normalise)",
     ["sve::sum_f64", "sve::sum_sq_dev_f64", "sve::normalise"]),
    ("layernorm::layernorm_backward_row_f32", 2, "layernorm backward row (two means, dinp)",
     ["sve::ln_backward_sums", "sve::ln_backward_update"]),
    ("adamw::update_chunk", 1, "AdamW update (p, g, m, v)", ["sve::adamw"]),
    ("adamw::chunk_sum_of_squares", 1, "sum of squares (gradient norm), f64 lanes",
     ["sve::sum_sq_dev_f64"]),
]
# The fugu-rows kernels that read and write 16-bit rows themselves (the fp16 step's SVE
# column uses them; the other ops stage their rows through f32 and are timed as f32 kernels).
HALF = {
    "gelu::gelu_rows_f32": ["sve::gelu_f16"],
    "gelu::gelu_backward_rows_f32": ["sve::gelu_backward_f16"],
    "layernorm::layernorm_row_f32": ["sve::sum_f64_f16", "sve::sum_sq_dev_f64_f16", "sve::normalise_f16"],
}
header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
insn = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
branch = re.compile(r"^(b(\.\w+)?|cbn?z|tbn?z)$")
target_re = re.compile(r"0x([0-9a-f]+)\b")


def functions(path):
    funcs, cur = {}, None
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip("\n")
        m = header.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = insn.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2), m.group(3).strip()))
    return funcs


def is_vector_fp(op, ops):
    return op.startswith("f") and re.search(r"\b[zv]\d+\.(s|d|4s|2d)\b", ops)


def vector_loads(op, ops):
    """Vector loads, in full vectors of f32 (a load of f32 into 64-bit lanes is half)."""
    if op == "ldp" and re.match(r"q\d+, q\d+", ops):
        return 2
    if op in ("ldr", "ldur") and re.match(r"[qz]\d+,", ops):
        return 1
    # f32 or 16-bit values into 64-bit lanes: half a vector of f32; 16-bit values into 32-bit
    # lanes (`ld1h {z.s}`) as many elements as an f32 load.
    if op in ("ld1w", "ld1h") and re.search(r"\{\s*z\d+\.d", ops):
        return 0.5
    if op.startswith("ld1") and re.search(r"\{\s*[zv]\d+", ops):
        return 1
    return 0


def vector_loops(body):
    """Every innermost loop with vector floating-point instructions."""
    found = []
    for addr, op, ops in body:
        if not branch.match(op):
            continue
        t = target_re.search(ops)
        if not t or int(t.group(1), 16) > addr:
            continue
        start = int(t.group(1), 16)
        loop = [x for x in body if start <= x[0] <= addr]
        nested = any(
            branch.match(x[1]) and (m := target_re.search(x[2]))
            and start <= int(m.group(1), 16) < x[0] < addr
            for x in loop
        )
        fp = sum(1 for x in loop if is_vector_fp(x[1], x[2]))
        if not nested and fp:
            found.append((fp, loop))
    return found


def streams(loop):
    """Distinct base registers of the vector loads: the arrays a loop streams through."""
    bases = set()
    for _, op, ops in loop:
        if vector_loads(op, ops):
            m = re.search(r"\[(\w+)", ops)
            if m:
                bases.add(m.group(1))
    return max(len(bases), 1)


def cycles(loop, path):
    with open(path, "w") as f:
        f.write(".Lloop:\n")
        end = loop[-1][0]
        for addr, op, ops in loop:
            if branch.match(op):
                # The back-branch to the loop's label, an exit to one after it (llvm-mca
                # times the straight-line body either way).
                ops = target_re.sub(".Lloop" if addr == end else ".Lexit", ops, count=1)
                ops = re.sub(r"\s*<.*>$", "", ops)
            ops = re.sub(r"\s*//.*$", "", ops)
            f.write(f"\t{op}\t{ops}\n" if ops else f"\t{op}\n")
        f.write(".Lexit:\n")
    r = subprocess.run([mca, "-march=aarch64", "-mcpu=a64fx", "-mattr=+sve",
                        "-iterations=300", path], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    it = int(re.search(r"^Iterations:\s+(\d+)", r.stdout, re.M).group(1))
    cy = int(re.search(r"^Total Cycles:\s+(\d+)", r.stdout, re.M).group(1))
    return cy / it


rows = []
# A kernel's cycles per element: the sum over its passes (a layernorm row makes three) of the
# loop's cycles per iteration over its elements per iteration (vector loads per stream x
# lanes). The compiler emits copies of a loop (versioned for aliasing, unrolled remainders):
# loops with the same instruction sequence count once, and the `passes` loops with the most
# vector FP instructions are taken.
def find(funcs, sym):
    pat = r"(^|::)" + re.escape(sym) + r"(::h[0-9a-f]+)?( \(\.llvm\.\d+\))?$"
    names = [n for n in funcs if re.search(pat, n)]
    return max((funcs[n] for n in names), key=len) if names else None


def timed(loops, build, sym):
    """Cycles per element summed over `loops`, the vector kinds, and a note per loop."""
    cpe, kinds, notes = 0.0, set(), []
    for i, (fp, loop) in enumerate(loops):
        sve = any(re.search(r"\bz\d+\.", x[2]) for x in loop)
        kinds.add("sve" if sve else "neon")
        loads = sum(vector_loads(x[1], x[2]) for x in loop)
        elems = loads / streams(loop) * (16 if sve else 4)
        c = cycles(loop, os.path.join(out, f"{build}-{sym.replace('::', '-')}-{i}.s"))
        if c is None or elems == 0:
            notes.append("a loop llvm-mca could not time or without loads")
            continue
        cpe += c / elems
        notes.append(f"{elems:.0f} el/{c:.1f} cyc")
    return cpe, "+".join(sorted(kinds)), "; ".join(notes)


for build in ("a64fx", "generic"):
    funcs = functions(os.path.join(out, f"{build}.dis"))
    for sym, passes, what, _ in KERNELS:
        body = find(funcs, sym)
        if body is None:
            rows.append((sym, build, None, None, None, "symbol not found"))
            continue
        loops = vector_loops(body)
        if not loops:
            rows.append((sym, build, None, None, None, "no vector loop"))
            continue
        distinct = {}
        for fp, l in loops:
            distinct.setdefault(tuple(x[1] for x in l), (fp, l))
        loops = sorted(distinct.values(), key=lambda t: -t[0])[:passes]
        cpe, kinds, note = timed(loops, build, sym)
        rows.append((sym, build, kinds, len(loops), cpe, note))

funcs = functions(os.path.join(out, "sve-asm.dis"))


def hand_written(sym, hand, build):
    """The row of fugu-rows kernels `hand` (one loop each) standing for `sym`."""
    loops, missing = [], []
    for h in hand:
        body = find(funcs, h)
        found = vector_loops(body) if body else []
        if not found:
            missing.append(h)
        loops += found[:1]
    if missing:
        return (sym, build, None, None, None, "no loop in " + ", ".join(missing))
    cpe, kinds, note = timed(loops, build, sym)
    return (sym, build, kinds, len(loops), cpe, note)


rows += [hand_written(sym, hand, "sve-f16") for sym, hand in HALF.items()]
rows += [hand_written(sym, hand, "sve-asm") for sym, _, _, hand in KERNELS]

with open(os.path.join(out, "rows.tsv"), "w") as f:
    f.write("kernel\tbuild\tvectors\tloops\tcycles_per_element\n")
    for sym, build, vec, nloops, cpe, note in rows:
        f.write(f"{sym}\t{build}\t{vec}\t{nloops}\t{cpe}\n")
print(f"{'kernel':<38} {'build':<8} {'vec':<5} {'loops':>5} {'cyc/elem':>9}  loops: elements/cycles per iteration")
for sym, build, vec, nloops, cpe, note in rows:
    if cpe is None:
        print(f"{sym:<38} {build:<8} {'-':<5} {'-':>5} {'-':>9}  {note}")
    else:
        print(f"{sym:<38} {build:<8} {vec:<5} {nloops:>5} {cpe:>9.3f}  {note}")
by = {(r[0], r[1]): r for r in rows}
print()
for sym, _, what, _ in KERNELS:
    a, g, h = (by.get((sym, b)) for b in ("a64fx", "generic", "sve-asm"))
    if a and g and h and a[4] and g[4] and h[4]:
        print(f"{what}: hand-written SVE {h[4]:.3f}, compiler SVE {a[4]:.3f} ({a[4] / h[4]:.1f}x), "
              f"compiler NEON {g[4]:.3f} ({g[4] / h[4]:.1f}x) cycles/element")

# The non-GEMM share of one GPT-2 124M training step (B = 1, T = 1024) on one A64FX CMG: 12
# cores at 2.2 GHz, 256 GB/s of HBM. Each op costs the larger of its compute time (elements x
# cycles/element above, over 12 cores) and its HBM time (bytes it reads and writes); the GEMMs
# run at 85% of the CMG's f32 peak (12 x 2.2 GHz x 64 FLOP/cycle).
# Then the same step in fp16 (16-bit activations in memory, `--precision fp16`): activation
# bytes halve (AdamW and the gradient norm stay f32), the GEMMs run at the f16 kernel's
# predicted share of the f16 peak relative to the f32 kernel's (94.1% over whole chunks
# against 99.9%: docs/KERNELS.md) on twice the FLOP/cycle, and the row kernels' compute is
# the 16-bit kernels' cycles where fugu-rows has them (GELU, the layernorm forward row: loads,
# widening and rounding included), the f32 kernels' elsewhere (those ops stage their rows
# through f32 in cache; the conversions are not counted).
L, C, H, V, T = 12, 768, 12, 50257, 1024
params = 124_439_808
causal = L * H * T * (T + 1) // 2                      # attention scores at or below the diagonal
gemm_flop = 6 * (12 * C * C * L + V * C) * T + 3 * 4 * T * T * C * L
cmg_hz, hbm = 12 * 2.2e9, 256e9
gemm_s = gemm_flop / (0.85 * cmg_hz * 64)
F16_GEMM_SPEEDUP = 2 * 0.941 / 0.999
OPS = [  # (op, kernel, elements, bytes per element through HBM in fp32; all activations but
    #    AdamW's and the gradient norm's, which read and write f32 in every precision)
    # One exponential per element: exp(x - max) stored with its sum, then the row (in L1 at
    # this T) scaled; the row is read from and written to HBM once between the two passes.
    ("attention softmax: exp and sum", "fastmath::exp_sum_f32", causal, 4),
    ("attention softmax: scale", "fastmath::scale_f32", causal, 4),
    ("attention softmax backward", "attention::softmax_backward_row_f32", causal, 12),
    ("cross-entropy: sum of exp", "fastmath::sum_exp_f32", T * V, 4),
    ("cross-entropy: probabilities", "fastmath::exp_scale_f32", T * V, 8),
    ("GELU forward", "gelu::gelu_rows_f32", L * T * 4 * C, 8),
    ("GELU backward", "gelu::gelu_backward_rows_f32", L * T * 4 * C, 12),
    ("layernorm forward", "layernorm::layernorm_row_f32", (2 * L + 1) * T * C, 8),
    ("layernorm backward", "layernorm::layernorm_backward_row_f32", (2 * L + 1) * T * C, 16),
    ("AdamW", "adamw::update_chunk", params, 28),
    ("gradient norm: sum of squares", "adamw::chunk_sum_of_squares", params, 4),
]
F32_ONLY = ("adamw::update_chunk", "adamw::chunk_sum_of_squares")


def step_table(precision):
    """The step's non-GEMM ops in `precision` (fp32 or fp16), ms, and their share."""
    half = precision == "fp16"
    g = gemm_s / F16_GEMM_SPEEDUP if half else gemm_s
    print()
    print(f"GPT-2 124M step in {precision}, B=1 T=1024, one A64FX CMG: GEMMs "
          f"{gemm_flop / 1e12:.3f} TFLOP in {g * 1e3:.0f} ms; non-GEMM ops, ms (each the "
          f"larger of compute and HBM time):")
    print(f"{'op':<32} {'HBM':>6} " + " ".join(f"{b:>9}" for b in ("sve-asm", "a64fx", "generic")))
    total = {b: 0.0 for b in ("sve-asm", "a64fx", "generic")}
    for op, sym, n, nbytes in OPS:
        mem = n * nbytes / hbm / (2 if half and sym not in F32_ONLY else 1)
        cells = []
        for b in total:
            r = by.get((sym, b))
            if half and b == "sve-asm" and by.get((sym, "sve-f16")):
                r = by[(sym, "sve-f16")]
            t = max(mem, n * r[4] / cmg_hz) if r and r[4] else None
            if t is None:
                total[b] = None if total[b] is None else float("nan")
            elif total[b] is not None:
                total[b] += t
            cells.append(f"{t * 1e3:>9.1f}" if t is not None else f"{'-':>9}")
        print(f"{op:<32} {mem * 1e3:>6.1f} " + " ".join(cells))
    print(f"{'total':<32} {'':>6} " + " ".join(
        f"{t * 1e3:>9.1f}" if t is not None else f"{'-':>9}" for t in total.values()))
    for b, t in total.items():
        if t is not None and t == t:
            print(f"{precision} {b}: non-GEMM {t * 1e3:.0f} ms = {100 * t / (t + g):.1f}% of a "
                  f"{(t + g) * 1e3:.0f} ms step")


for precision in ("fp32", "fp16"):
    step_table(precision)
PY
