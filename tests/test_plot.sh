#!/usr/bin/env bash
# megatrain plot: the metrics of two short real runs drawn as a PNG, which is then opened (its
# signature, its IHDR size, its pixels inflated and unfiltered: both plots hold drawn pixels), and
# each refusal: a missing file, a line that is not JSON, no steps, no gnuplot, OUT not writable,
# gnuplot failing (OUT kept as it was). Skips (77) without gnuplot.
# Usage: test_plot.sh PATH/TO/megatrain. Prints one line per check, then "N passed, M failed".
set -u

megatrain=${1:?usage: test_plot.sh PATH/TO/megatrain}
case $megatrain in /*) ;; *) megatrain=$PWD/$megatrain ;; esac
if [ ! -x "$megatrain" ]; then
    echo "test_plot.sh: $megatrain is not an executable" >&2
    exit 2
fi
if ! command -v gnuplot >/dev/null 2>&1; then
    echo "test_plot.sh: no gnuplot (Debian's gnuplot-nox): skipped"
    exit 77
fi

work=$(mktemp -d /tmp/mt-plot.XXXXXX)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 2
export STARPU_SILENT=1
export STARPU_HOME=${STARPU_HOME:-$work/starpu-home}
mkdir -p "$STARPU_HOME"

passed=0
failed=0
rc=0
pass() { passed=$((passed + 1)); echo "ok   $1"; }
fail() {
    failed=$((failed + 1))
    echo "FAIL $1: $2"
    echo "     exit status $rc; stdout:"; sed -n '1,10s/^/       /p' out.txt
    echo "     stderr:"; sed -n '1,10s/^/       /p' err.txt
}
run() {
    "$megatrain" "$@" >out.txt 2>err.txt
    rc=$?
}
# refused NAME PATTERN ARGS...: plot exits 1 or 2 and stderr matches PATTERN.
refused() {
    local name=$1 pattern=$2
    shift 2
    run plot "$@"
    if [ "$rc" -ne 1 ] && [ "$rc" -ne 2 ]; then fail "$name" "expected exit status 1 or 2"
    elif ! grep -qE -- "$pattern" err.txt; then fail "$name" "stderr does not match '$pattern'"
    else pass "$name"; fi
}

# Two short runs of the built-in model on a generated corpus, the second at another learning rate.
for i in $(seq 1 1500); do echo "Line $i: the quick brown fox number $((i * 7919 % 1000)) jumps."; done >corpus.txt
small=(--data corpus.txt --steps 8 --micro-batch 2 --seq-len 32 --sample-bytes 0 --eval-every 4 --log-every 4
       --ncpu 2 --ncuda 0)
"$megatrain" train "${small[@]}" --metrics a.jsonl >train.log 2>&1 || { cat train.log; echo "setup: train failed"; exit 1; }
"$megatrain" train "${small[@]}" --lr 3e-3 --metrics b.jsonl >train.log 2>&1 ||
    { cat train.log; echo "setup: the second train failed"; exit 1; }

# check_png NAME FILE W H: a PNG of W x H whose top and bottom halves each hold drawn pixels.
check_png() {
    local name=$1 file=$2 w=$3 h=$4 why
    if ! why=$(python3 - "$file" "$w" "$h" 2>&1 <<'PY'
import struct, sys, zlib
path, want_w, want_h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = open(path, "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "no PNG signature"
pos, chunks = 8, []
while pos < len(data):
    length, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + length]
    assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0], "bad CRC"
    chunks.append((kind, body))
    pos += 12 + length
assert chunks[0][0] == b"IHDR", "the first chunk is not IHDR"
w, h, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
assert (w, h) == (want_w, want_h), f"IHDR says {w}x{h}, expected {want_w}x{want_h}"
assert depth == 8 and interlace == 0, f"bit depth {depth}, interlace {interlace}: not what this check decodes"
bpp = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[colour]
raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
stride = w * bpp
assert len(raw) == h * (stride + 1), f"{len(raw)} bytes inflated, expected {h * (stride + 1)}"
rows, prev = [], bytearray(stride)
for y in range(h):
    f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if f == 1: line[i] = (line[i] + a) & 255
        elif f == 2: line[i] = (line[i] + b) & 255
        elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        else: assert f == 0, f"filter {f}"
    rows.append(bytes(line))
    prev = line
def pixels(lines):
    return [l[i:i + bpp] for l in lines for i in range(0, stride, bpp)]
allpx = pixels(rows)
background = max(set(allpx), key=allpx.count)
colours = len(set(allpx))
assert colours >= 3, f"{colours} colours: nothing drawn"
for half, lines in (("top", rows[:h // 2]), ("bottom", rows[h // 2:])):
    px = pixels(lines)
    drawn = sum(p != background for p in px) / len(px)
    # axes, tics, labels and at least one curve: well above 0.5% of a half's pixels
    assert drawn > 0.005, f"the {half} half has {100 * drawn:.3f}% drawn pixels"
PY
)
    then fail "$name" "$why"
    else pass "$name"; fi
}

name="plot two runs: a PNG of the asked size with both plots drawn"
run plot a.jsonl b.jsonl -o run.png --size 640x480 --title "two runs"
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
elif ! grep -q "^plot: 2 runs, 16 steps, written to run.png (640x480)$" out.txt; then fail "$name" "no 'plot: 2 runs' line"
elif ls run.png.tmp.* >/dev/null 2>&1; then fail "$name" "a temporary file was left"
else check_png "$name" run.png 640 480; fi

name="plot one run at the default size"
run plot a.jsonl -o one.png
if [ "$rc" -ne 0 ]; then fail "$name" "expected exit status 0"
else check_png "$name" one.png 1000 800; fi

name="plot --help"
run plot --help
if [ "$rc" -ne 0 ] || ! grep -q '^usage: megatrain plot FILE' out.txt; then fail "$name" "no usage, or a non-zero exit"
else pass "$name"; fi

printf '{"step": 1, "loss": 5.5, "tokens_per_s": 100.0}\n{"step": 2, "loss": 5.4, "tokens_per_s": 101.0}\nnot json\n' >bad.jsonl
printf '{"step": 1, "loss": 5.5}\n["step", 2]\n' >notrow.jsonl
: >empty.jsonl
mkdir -p nogp adir
refused "plot a missing file" "^megatrain plot: nope.jsonl: cannot open: No such file" nope.jsonl -o x.png
refused "plot a line that is not JSON names FILE:LINE" "^megatrain plot: bad.jsonl:3: not JSON" bad.jsonl -o x.png
refused "plot a JSON line that is not a step" "^megatrain plot: notrow.jsonl:2: not a metrics line" notrow.jsonl -o x.png
refused "plot an empty file: no steps" "^megatrain plot: empty.jsonl: no steps" a.jsonl empty.jsonl -o x.png
refused "plot OUT in a missing directory" "^megatrain plot: -o nodir/x.png: cannot be written" a.jsonl -o nodir/x.png
refused "plot OUT a directory" "^megatrain plot: -o adir: is a directory" a.jsonl -o adir
refused "plot without -o" "-o OUT.png is required" a.jsonl
refused "plot without a file" "no metrics FILE given" -o x.png
refused "plot --size 5x5" "--size: '5x5' is not WxH" a.jsonl -o x.png --size 5x5
[ -e x.png ] && fail "refusals write nothing" "x.png exists"

name="plot without gnuplot names the package"
PATH=$work/nogp "$megatrain" plot a.jsonl -o x.png >out.txt 2>err.txt
rc=$?
if [ "$rc" -ne 1 ]; then fail "$name" "expected exit status 1"
elif ! grep -q "gnuplot is not installed.*gnuplot-nox" err.txt; then fail "$name" "no message naming gnuplot-nox"
else pass "$name"; fi

# A gnuplot that fails: OUT keeps its old bytes and no temporary is left.
mkdir -p badgp
printf '#!/bin/sh\ncat >/dev/null\necho "gnuplot: broken" >&2\nexit 3\n' >badgp/gnuplot
chmod +x badgp/gnuplot
echo old >kept.png
name="plot when gnuplot fails keeps OUT as it was"
PATH=$work/badgp:$PATH "$megatrain" plot a.jsonl -o kept.png >out.txt 2>err.txt
rc=$?
if [ "$rc" -ne 1 ]; then fail "$name" "expected exit status 1"
elif ! grep -q "gnuplot (.*badgp/gnuplot) failed with exit status 3" err.txt; then fail "$name" "no message on gnuplot's exit"
elif [ "$(cat kept.png)" != old ]; then fail "$name" "OUT was changed"
elif ls kept.png.tmp.* >/dev/null 2>&1; then fail "$name" "a temporary file was left"
else pass "$name"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
