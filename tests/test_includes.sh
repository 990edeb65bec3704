#!/bin/sh
# The direction of the house, checked on every #include "..." of the sources:
#   tools -> runtime -> codelets -> backends, and models are used by all, so
#   models/ includes nothing of runtime/, codelets/ or backends/; codelets/ nothing of runtime/;
#   backends/ nothing of runtime/ or codelets/;
# and every include of a project header names its folder from the source root (the build's only
# include path), except the headers the build generates. Prints every violation, then fails if
# there was one. Usage: test_includes.sh [SOURCE_ROOT] (default: MT_SOURCE_ROOT, else the parent
# of this script's folder).
root=${1:-${MT_SOURCE_ROOT:-$(dirname "$0")/..}}
cd "$root" || { echo "test_includes: cannot enter the source root '$root'"; exit 2; }

# Headers the build writes into the build directory (meson.build, tools/meson.build).
generated="mt_build_config.h mt_commit.h"

bad=0
files=$(find models runtime codelets backends tools tests -name node_modules -prune -o -type f \
    \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \) -print | sort)
[ -n "$files" ] || { echo "test_includes: no sources under $root"; exit 2; }

for f in $files; do
    folder=${f%%/*}
    # "LINE:HEADER" for each quoted include of the file
    grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
        sed 's/^\([0-9]*\):[^"]*"\([^"]*\)".*/\1:\2/' > "${TMPDIR:-/tmp}/test_includes.$$"
    while IFS=: read -r line header; do
        case " $generated " in *" $header "*) continue ;; esac
        target=${header%%/*}
        why=
        if [ "$target" = "$header" ] || [ ! -f "$header" ]; then
            why="names no header of the tree from the source root (write \"folder/file.h\")"
        else
            case "$folder:$target" in
            models:runtime | models:codelets | models:backends)
                why="models/ describes and is used by all: it includes nothing of $target/" ;;
            codelets:runtime)
                why="codelets/ sits below runtime/ (tools -> runtime -> codelets -> backends)" ;;
            backends:runtime | backends:codelets)
                why="backends/ sits at the bottom (tools -> runtime -> codelets -> backends): it includes nothing of $target/" ;;
            esac
        fi
        if [ -n "$why" ]; then
            echo "$f:$line: #include \"$header\": $why"
            bad=$((bad + 1))
        fi
    done < "${TMPDIR:-/tmp}/test_includes.$$"
done
rm -f "${TMPDIR:-/tmp}/test_includes.$$"

if [ "$bad" -gt 0 ]; then
    echo "test_includes: $bad include(s) break the house's direction or do not name their folder"
    exit 1
fi
echo "test_includes: every include names its folder and follows tools -> runtime -> codelets -> backends"
