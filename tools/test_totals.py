#!/usr/bin/env python3
"""Sums a meson test log into one line, 'N passed, N failed'. Check suites count their checks
(from 'Checks: N, Failures: F, Errors: E'), scripts that print 'N passed, M failed' count theirs,
any other test counts as one, a skipped one (exit 77) not at all; a suite that died before its summary counts as one failure more."""
import json
import re
import sys

check_re = re.compile(r"Checks: (\d+), Failures: (\d+), Errors: (\d+)")
plain_re = re.compile(r"^(\d+) passed, (\d+) failed", re.M)

def main(path):
    passed = failed = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            t = json.loads(line)
            out = (t.get("stdout") or "") + (t.get("stderr") or "")
            result = t.get("result")
            if result == "SKIP":
                continue  # e.g. the GPU suites on a machine without a GPU
            ok = result == "OK"
            m = check_re.findall(out)
            p = plain_re.findall(out)
            if m:
                n, fl, er = (int(x) for x in m[-1])
                passed += n - fl - er
                failed += fl + er
            elif p:
                passed += int(p[-1][0])
                failed += int(p[-1][1])
            else:
                passed += ok
                failed += not ok
                continue
            if not ok and (m and int(m[-1][1]) + int(m[-1][2]) == 0 or p and int(p[-1][1]) == 0):
                failed += 1  # the process failed although its own summary did not say so
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
