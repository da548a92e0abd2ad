#!/usr/bin/env bash
# Predicts the A64FX FMA-pipe utilisation of the SVE micro-kernel's inner k loop with llvm-mca.
#
#   scripts/predict-a64fx.sh            # exits non-zero below the threshold
#   FUGU_MCA_THRESHOLD=85 scripts/predict-a64fx.sh
#
# Steps: release build of fugu-gemm for aarch64 (Debian rustc, as in scripts/test-aarch64.sh);
# disassemble the rlib; find the kernel function (FUGU_MCA_FUNC, default fugu_sve_sgemm_2vx10);
# among its backward branches take the loop whose body holds the most `fmla` (the k loop);
# write it to loop.s (in FUGU_MCA_OUT, default target/aarch64/mca); run
#   llvm-mca-14 -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations=300 loop.s
# and report utilisation = (fmla per iteration × 0.5 cycles) / (Total Cycles / iterations):
# the A64FX has two FP pipes, so each FMLA needs half a cycle of FMA-pipe time.
set -euo pipefail

cd "$(dirname "$0")/.."

die() {
    echo "predict-a64fx.sh: $*" >&2
    exit 1
}

THRESHOLD="${FUGU_MCA_THRESHOLD:-90}"
FUNC="${FUGU_MCA_FUNC:-fugu_sve_sgemm_2vx10}"
ITERATIONS="${FUGU_MCA_ITERATIONS:-300}"
OUT="${FUGU_MCA_OUT:-target/aarch64/mca}"
OBJDUMP="${LLVM_OBJDUMP:-llvm-objdump-14}"
MCA="${LLVM_MCA:-llvm-mca-14}"

[[ -x /usr/bin/rustc ]] || die "/usr/bin/rustc (Debian rustc-web) is missing; run scripts/install-deps.sh"
command -v aarch64-linux-gnu-gcc >/dev/null || die "aarch64-linux-gnu-gcc is missing; run scripts/install-deps.sh"
command -v "$OBJDUMP" >/dev/null || die "$OBJDUMP is missing (llvm-14); run scripts/install-deps.sh"
command -v "$MCA" >/dev/null || die "$MCA is missing (llvm-14); run scripts/install-deps.sh"
command -v python3 >/dev/null || die "python3 is missing"

TARGET=aarch64-unknown-linux-gnu
export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
export CARGO_TARGET_DIR=target/aarch64
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static"
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

echo "== release build of fugu-gemm for $TARGET"
cargo build --release -p fugu-gemm --target "$TARGET"
RLIB="$CARGO_TARGET_DIR/$TARGET/release/libfugu_gemm.rlib"
[[ -f "$RLIB" ]] || die "$RLIB not found after the build"

mkdir -p "$OUT"
# The rlib also holds a metadata member that is not an object file; objdump warns and goes on.
"$OBJDUMP" -d --no-show-raw-insn --mattr=+sve --demangle "$RLIB" >"$OUT/lib.dis" 2>"$OUT/objdump.err" || true
[[ -s "$OUT/lib.dis" ]] || die "$OBJDUMP produced no disassembly (see $OUT/objdump.err)"

echo "== extracting the inner k loop of $FUNC"
python3 - "$OUT/lib.dis" "$FUNC" "$OUT/loop.s" <<'PY'
import re
import sys

dis_path, func, out_path = sys.argv[1:4]
lines = open(dis_path, encoding="utf-8", errors="replace").read().splitlines()

# Function headers look like `0000000000000000 <path::fugu_sve_sgemm_2vx10::h0123 (.llvm.42)>:`.
header = re.compile(r"^[0-9a-f]+ <(.*)>:$")
insn = re.compile(r"^\s*([0-9a-f]+):\s+(\S+)\s*(.*)$")
bodies = []
cur = None
for line in lines:
    m = header.match(line)
    if m:
        cur = [] if re.search(r"(^|::)" + re.escape(func) + r"(::|\s|$)", m.group(1)) else None
        if cur is not None:
            bodies.append((m.group(1), cur))
        continue
    if cur is None:
        continue
    m = insn.match(line)
    if m:
        addr, op, ops = int(m.group(1), 16), m.group(2), m.group(3).strip()
        cur.append((addr, op, ops))
    elif line.strip() == "" and cur:
        cur = None
if not bodies:
    sys.exit(f"predict-a64fx: function {func} not found in the disassembly")
if len(bodies) > 1:
    print(f"note: {len(bodies)} copies of {func}; using the largest", file=sys.stderr)
name, body = max(bodies, key=lambda b: len(b[1]))
print(f"function: {name} ({len(body)} instructions)")

# Backward branches: b, b.cond, cbz/cbnz, tbz/tbnz whose target precedes them.
branch_ops = re.compile(r"^(b(\.\w+)?|cbn?z|tbn?z)$")
target_re = re.compile(r"0x([0-9a-f]+)\b")
best = None
for i, (addr, op, ops) in enumerate(body):
    if not branch_ops.match(op):
        continue
    t = target_re.search(ops)
    if not t:
        continue
    target = int(t.group(1), 16)
    if target > addr:
        continue
    loop = [x for x in body if target <= x[0] <= addr]
    fmla = sum(1 for x in loop if x[1] == "fmla")
    if best is None or fmla > best[0]:
        best = (fmla, target, addr, loop)
if best is None or best[0] == 0:
    sys.exit(f"predict-a64fx: no backward-branch loop with fmla found in {func}")
fmla, target, end, loop = best
with open(out_path, "w") as f:
    f.write("# inner k loop of %s, 0x%x..0x%x\n" % (func, target, end))
    f.write(".Lkloop:\n")
    for addr, op, ops in loop:
        if addr == end:
            # The back-branch: point it at the label (objdump prints an address and a comment).
            ops = target_re.sub(".Lkloop", ops, count=1)
            ops = re.sub(r"\s*<.*>$", "", ops)
        ops = re.sub(r"\s*//.*$", "", ops)
        f.write(f"\t{op}\t{ops}\n" if ops else f"\t{op}\n")
print(f"loop: 0x{target:x}..0x{end:x}, {len(loop)} instructions, {fmla} fmla")
PY

echo "== $OUT/loop.s"
cat "$OUT/loop.s"

CMD=("$MCA" -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations="$ITERATIONS" "$OUT/loop.s")
echo
echo "== ${CMD[*]}"
"${CMD[@]}" >"$OUT/mca.txt"
# Summary, resource legend and per-iteration pressure (the full report is in $OUT/mca.txt).
sed -n '1,/^Instruction Info/p' "$OUT/mca.txt" | sed '/^Instruction Info/d'
sed -n '/^Resources:/,/^$/p;/^Resource pressure per iteration/,/^$/p' "$OUT/mca.txt"

python3 - "$OUT/loop.s" "$OUT/mca.txt" "$THRESHOLD" <<'PY'
import re
import sys

loop_path, mca_path, threshold = sys.argv[1], sys.argv[2], float(sys.argv[3])
loop = open(loop_path).read().splitlines()
mca = open(mca_path).read()
ops = [l.split()[0] for l in loop if l.startswith("\t")]
fmla = ops.count("fmla")
loads = sum(1 for o in ops if o.startswith("ld"))
iters = int(re.search(r"^Iterations:\s+(\d+)", mca, re.M).group(1))
cycles = int(re.search(r"^Total Cycles:\s+(\d+)", mca, re.M).group(1))
per_iter = cycles / iters
floor = fmla * 0.5
util = floor / per_iter
print(f"per iteration: {len(ops)} instructions, {fmla} fmla, {loads} loads")
print(f"cycles per iteration: {per_iter:.2f} (FMA-pipe floor {floor:.1f})")
print(f"FMA-pipe utilisation: {100 * util:.1f}% (threshold {threshold:g}%)")
if 100 * util < threshold:
    print("predict-a64fx: utilisation below the threshold", file=sys.stderr)
    sys.exit(1)
PY
