#!/usr/bin/env bash
# Predicts A64FX cycles per element of the non-GEMM row kernels with llvm-mca, for the fugu
# library built two ways for aarch64:
#   a64fx:   -C target-cpu=a64fx (the Fugaku build, scripts/build-fugaku.sh): 512-bit SVE
#   generic: the default aarch64 target: 128-bit NEON, the plain-Rust fallback a build that is
#            not tuned for A64FX runs
#
#   scripts/predict-a64fx-rows.sh
#
# For each kernel (the `dispatch_rows!` functions of src/ops: the softmax/cross-entropy
# exponentials, GELU forward and backward, the AdamW update, the sum of squares of the
# gradient norm) the script disassembles the release rlib, takes the innermost loop with the
# most vector floating-point instructions, runs
#   llvm-mca-14 -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations=300 loop.s
# and divides the cycles per iteration by the elements per iteration: vector loads per
# iteration / input streams of the kernel x lanes (16 f32 per SVE z register on A64FX, 4 per
# NEON q register; `ldp q` counts two). Output: a table, and target/aarch64-rows/rows.tsv.
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

python3 - "$OUT" "$MCA" <<'PY'
import os
import re
import subprocess
import sys

out, mca = sys.argv[1], sys.argv[2]
# kernel symbol (module::function), input streams read per element, what it is.
KERNELS = [
    ("fastmath::sum_exp_f32", 1, "softmax / cross-entropy: sum of exp(x - max)"),
    ("fastmath::exp_scale_f32", 1, "softmax: scale·exp(x - max), in place"),
    ("gelu::gelu_rows_f32", 1, "GELU forward (tanh form)"),
    ("gelu::gelu_backward_rows_f32", 2, "GELU backward"),
    ("adamw::update_chunk", 4, "AdamW update (p, g, m, v)"),
    ("adamw::chunk_sum_of_squares", 1, "sum of squares (gradient norm), f64 lanes"),
]
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
    if op == "ldp" and re.match(r"q\d+, q\d+", ops):
        return 2
    if op in ("ldr", "ldur") and re.match(r"[qz]\d+,", ops):
        return 1
    if op.startswith("ld1") and re.search(r"\{\s*[zv]\d+", ops):
        return 1
    return 0


def best_loop(body):
    best = None
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
        if not nested and fp and (best is None or fp > best[0]):
            best = (fp, loop)
    return best


def cycles(loop, path):
    with open(path, "w") as f:
        f.write(".Lloop:\n")
        end = loop[-1][0]
        for addr, op, ops in loop:
            if addr == end:
                ops = target_re.sub(".Lloop", ops, count=1)
                ops = re.sub(r"\s*<.*>$", "", ops)
            ops = re.sub(r"\s*//.*$", "", ops)
            f.write(f"\t{op}\t{ops}\n" if ops else f"\t{op}\n")
    r = subprocess.run([mca, "-march=aarch64", "-mcpu=a64fx", "-mattr=+sve",
                        "-iterations=300", path], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    it = int(re.search(r"^Iterations:\s+(\d+)", r.stdout, re.M).group(1))
    cy = int(re.search(r"^Total Cycles:\s+(\d+)", r.stdout, re.M).group(1))
    return cy / it


rows = []
for build in ("a64fx", "generic"):
    funcs = functions(os.path.join(out, f"{build}.dis"))
    for sym, streams, what in KERNELS:
        names = [n for n in funcs if re.search(r"(^|::)" + re.escape(sym) + r"(::h[0-9a-f]+)?$", n)]
        if not names:
            rows.append((sym, build, None, None, None, "symbol not found"))
            continue
        body = max((funcs[n] for n in names), key=len)
        found = best_loop(body)
        if not found:
            rows.append((sym, build, None, None, None, "no vector loop"))
            continue
        fp, loop = found
        sve = any(re.search(r"\bz\d+\.", x[2]) for x in loop)
        lanes = 16 if sve else 4
        loads = sum(vector_loads(x[1], x[2]) for x in loop)
        elems = loads / streams * lanes
        c = cycles(loop, os.path.join(out, f"{build}-{sym.replace('::', '-')}.s"))
        if c is None or elems == 0:
            rows.append((sym, build, None, None, None, "llvm-mca failed or no loads"))
            continue
        rows.append((sym, build, "sve" if sve else "neon", elems, c, f"{len(loop)} insns, {fp} vector fp"))

with open(os.path.join(out, "rows.tsv"), "w") as f:
    f.write("kernel\tbuild\tvectors\telements_per_iter\tcycles_per_iter\tcycles_per_element\n")
    for sym, build, vec, elems, c, note in rows:
        cpe = c / elems if c and elems else None
        f.write(f"{sym}\t{build}\t{vec}\t{elems}\t{c}\t{cpe}\n")
print(f"{'kernel':<30} {'build':<8} {'vec':<5} {'elem/it':>7} {'cyc/it':>7} {'cyc/elem':>9}")
for sym, build, vec, elems, c, note in rows:
    if c is None:
        print(f"{sym:<30} {build:<8} {'-':<5} {'-':>7} {'-':>7} {'-':>9}  {note}")
    else:
        print(f"{sym:<30} {build:<8} {vec:<5} {elems:>7.0f} {c:>7.2f} {c / elems:>9.3f}  {note}")
by = {(r[0], r[1]): r for r in rows}
print()
for sym, _, what in KERNELS:
    a, g = by.get((sym, "a64fx")), by.get((sym, "generic"))
    if a and g and a[4] and g[4]:
        print(f"{what}: SVE {a[4] / a[3]:.3f} vs NEON {g[4] / g[3]:.3f} cycles/element "
              f"({(g[4] / g[3]) / (a[4] / a[3]):.1f}x)")
PY
