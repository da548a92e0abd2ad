#!/usr/bin/env bash
# Predicts the A64FX FMA-pipe utilisation of the SVE micro-kernel's inner k loop with llvm-mca.
#
#   scripts/predict-a64fx.sh            # exits non-zero below the threshold
#   FUGU_MCA_THRESHOLD=85 scripts/predict-a64fx.sh
#   FUGU_MCA_FUNC=fugu_sve_hgemm_2vx10 FUGU_MCA_CHUNK=64 scripts/predict-a64fx.sh   # the f16 kernel
#
# With FUGU_MCA_CHUNK (the f16 kernel's F16_CHUNK), also the utilisation over a whole chunk:
# the k loop for CHUNK steps plus, once per chunk, the accumulator zeroing/first loads and the
# fold of the f16 accumulators into f32: printed with those pieces timed one-shot and summed (no
# overlap), and checked against the threshold with whole chunks run back to back (chunk.s:
# straight-line prologue + CHUNK/4 k-loop bodies + fold, repeated), where the fold overlaps the
# next chunk's start as far as the core's windows allow.
#
# Steps: release build of fugu-gemm for aarch64 (Debian rustc, as in scripts/test-aarch64.sh);
# disassemble the rlib; find the kernel function (FUGU_MCA_FUNC, default fugu_sve_sgemm_2vx10);
# among its innermost backward-branch loops take the one whose body holds the most `fmla` (the
# k loop);
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
    # Innermost loops only: a loop around another (the f16 kernel's chunk loop) is not the
    # k loop.
    nested = any(
        branch_ops.match(x[1])
        and (m := target_re.search(x[2]))
        and target <= int(m.group(1), 16) < x[0] < addr
        for x in loop
    )
    if nested:
        continue
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

# For kernels that fold f16 chunks into f32 (FUGU_MCA_CHUNK steps per chunk): the straight-line
# pieces run once per chunk, the accumulator zeroing and loads before the k loop (from the
# enclosing loop's start) and the fold (the run of instructions from the first `lsr` after the
# k loop: the odd f16 lanes shifted down for `fcvt`).
import os
if os.environ.get("FUGU_MCA_CHUNK"):
    def write(path, insns):
        with open(path, "w") as f:
            for addr, op, ops in insns:
                ops = re.sub(r"\s*//.*$", "", ops)
                f.write(f"\t{op}\t{ops}\n" if ops else f"\t{op}\n")
    outer = [
        (int(target_re.search(x[2]).group(1), 16), x[0])
        for x in body
        if branch_ops.match(x[1]) and target_re.search(x[2])
        and int(target_re.search(x[2]).group(1), 16) < target < x[0]
    ]
    if not outer:
        sys.exit("predict-a64fx: FUGU_MCA_CHUNK set but no chunk loop around the k loop")
    start = max(o[0] for o in outer)
    prologue = [x for x in body if start <= x[0] < target and not branch_ops.match(x[1])]
    fold_ops = ("uunpklo", "uunpkhi", "lsr", "fcvt", "ld1w", "fadd", "st1w", "addvl")
    first = next(i for i, x in enumerate(body) if x[0] > end and x[1] in fold_ops[:5])
    fold = []
    for x in body[first:]:
        if x[1] not in fold_ops:
            break
        fold.append(x)
    write(os.path.join(os.path.dirname(out_path), "prologue.s"), prologue)
    write(os.path.join(os.path.dirname(out_path), "fold.s"), fold)
    print(f"chunk pieces: prologue {len(prologue)} instructions, fold {len(fold)} instructions")
    # The whole chunk as the core runs it, straight-line: the prologue, CHUNK/4 k-loop bodies
    # (4 steps each, back-branch dropped) and the fold; llvm-mca repeats it, so the fold's tail
    # overlaps the next chunk's zeroing and first loads as far as A64FX's windows allow.
    body_insns = [x for x in loop if not branch_ops.match(x[1])]
    chunk = int(os.environ["FUGU_MCA_CHUNK"])
    write(os.path.join(os.path.dirname(out_path), "chunk.s"),
          prologue + body_insns * (chunk // 4) + fold)
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

if [[ -n "${FUGU_MCA_CHUNK:-}" ]]; then
    # One-shot cycles (latency included) of the once-per-chunk pieces, and the chunk's
    # utilisation: CHUNK steps of the k loop (4 steps per iteration) plus those pieces.
    "$MCA" -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations=1 "$OUT/prologue.s" >"$OUT/mca-prologue.txt"
    "$MCA" -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations=1 "$OUT/fold.s" >"$OUT/mca-fold.txt"
    python3 - "$OUT/loop.s" "$OUT/mca.txt" "$OUT/mca-prologue.txt" "$OUT/mca-fold.txt" "$FUGU_MCA_CHUNK" "$THRESHOLD" <<'PY'
import re
import sys

loop_path, mca, pro, fold, chunk, threshold = sys.argv[1:7]
chunk, threshold = int(chunk), float(threshold)
cyc = lambda p: int(re.search(r"^Total Cycles:\s+(\d+)", open(p).read(), re.M).group(1))
its = lambda p: int(re.search(r"^Iterations:\s+(\d+)", open(p).read(), re.M).group(1))
ops = [l.split()[0] for l in open(loop_path).read().splitlines() if l.startswith("\t")]
steps_per_iter = 4
fmla_per_step = ops.count("fmla") / steps_per_iter
per_iter = cyc(mca) / its(mca)
total = chunk / steps_per_iter * per_iter + cyc(pro) + cyc(fold)
floor = chunk * fmla_per_step * 0.5
print(f"chunk of {chunk} steps: {chunk // steps_per_iter} k-loop iterations x {per_iter:.2f} cycles "
      f"+ prologue {cyc(pro)} + fold {cyc(fold)} cycles (one-shot) = {total:.0f} cycles, "
      f"FMA-pipe floor {floor:.0f}")
print(f"FMA-pipe utilisation over a whole chunk, pieces timed one-shot (no overlap): {100 * floor / total:.1f}%")
PY
    "$MCA" -march=aarch64 -mcpu=a64fx -mattr=+sve -iterations=20 "$OUT/chunk.s" >"$OUT/mca-chunk.txt"
    python3 - "$OUT/loop.s" "$OUT/mca-chunk.txt" "$FUGU_MCA_CHUNK" "$THRESHOLD" <<'PY'
import re
import sys

loop_path, mca, chunk, threshold = sys.argv[1:5]
chunk, threshold = int(chunk), float(threshold)
text = open(mca).read()
cycles = int(re.search(r"^Total Cycles:\s+(\d+)", text, re.M).group(1))
iters = int(re.search(r"^Iterations:\s+(\d+)", text, re.M).group(1))
ops = [l.split()[0] for l in open(loop_path).read().splitlines() if l.startswith("\t")]
floor = chunk * ops.count("fmla") / 4 * 0.5
per = cycles / iters
print(f"whole chunks back to back (chunk.s, {iters} iterations): {per:.0f} cycles per chunk, "
      f"FMA-pipe floor {floor:.0f}")
print(f"FMA-pipe utilisation over a whole chunk: {100 * floor / per:.1f}% (threshold {threshold:g}%)")
if 100 * floor / per < threshold:
    print("predict-a64fx: chunk utilisation below the threshold", file=sys.stderr)
    sys.exit(1)
PY
fi
