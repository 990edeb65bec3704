#!/usr/bin/env python3
"""Sums meson test logs (one or more) into one line, 'N passed, N failed'. Check suites count their checks
(from 'Checks: N, Failures: F, Errors: E'), scripts that print 'N passed, M failed' count theirs,
any other test counts as one, a skipped one (exit 77) not at all; a suite that died before its summary counts as one failure more."""
import json
import re
import sys

check_re = re.compile(r"Checks: (\d+), Failures: (\d+), Errors: (\d+)")
plain_re = re.compile(r"^(\d+) passed, (\d+) failed", re.M)

def tally(t):
    """(passed, failed) of one test record of a meson test log."""
    out = (t.get("stdout") or "") + (t.get("stderr") or "")
    result = t.get("result")
    if result == "SKIP":
        return 0, 0  # e.g. the GPU suites on a machine without a GPU
    ok = result == "OK"
    m = check_re.findall(out)
    p = plain_re.findall(out)
    if m:
        n, fl, er = (int(x) for x in m[-1])
        passed, failed = n - fl - er, fl + er
    elif p:
        passed, failed = int(p[-1][0]), int(p[-1][1])
    else:
        return int(ok), int(not ok)
    if not ok and failed == 0:
        failed += 1  # the process failed although its own summary did not say so
    return passed, failed

def main(paths):
    passed = failed = 0
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                p, fl = tally(json.loads(line))
                passed += p
                failed += fl
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: test_totals.py TESTLOG.json [TESTLOG.json ...]")
    sys.exit(main(sys.argv[1:]))
