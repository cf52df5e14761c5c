#!/usr/bin/env bash
# Run a command as on a machine with only Python and pip: Go and every C/C++
# compiler hidden from PATH, CC/CXX unset. For checking that `pip install .`
# needs nothing else (issue 17):
#
#     bash tools/without-toolchains.sh bash -c 'python3 -m venv /tmp/v && /tmp/v/bin/pip install . && /tmp/v/bin/python -m gpumempool demo --steps 50'
#
# Each directory of PATH is replaced by a directory of links to its entries
# less the hidden ones (go, gofmt, cc, gcc*, c++, g++*, clang*, <triplet>-gcc*,
# ...); nothing on the machine is changed. The command's exit status is the
# script's.
set -euo pipefail
[[ $# -gt 0 ]] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }

hidden() {
  case "$1" in
    go|gofmt|cc|c++|c89|c99|gcc|gcc-*|g++|g++-*|clang|clang-*|clang++|clang++-*|zig|tcc) return 0 ;;
    *-linux-gnu-gcc*|*-linux-gnu-g++*|*-linux-gnu-c++*|*-linux-gnu-cc) return 0 ;;
  esac
  return 1
}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/gmp-notoolchain.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
newpath=""
n=0
IFS=: read -r -a dirs <<<"$PATH"
for d in "${dirs[@]}"; do
  [[ -d "$d" ]] || continue
  n=$((n + 1))
  mirror=$TMP/$n
  mkdir "$mirror"
  for f in "$d"/*; do
    name=${f##*/}
    [[ -e "$f" ]] || continue
    hidden "$name" && continue
    ln -s "$f" "$mirror/$name"
  done
  newpath=${newpath:+$newpath:}$mirror
done

for tool in go cc gcc c++ g++ clang; do
  if PATH=$newpath command -v "$tool" >/dev/null 2>&1; then
    echo "without-toolchains: $tool is still on PATH" >&2
    exit 1
  fi
done
echo "without-toolchains: go, cc, gcc, c++, g++ and clang hidden from PATH; CC/CXX unset" >&2
env -u CC -u CXX -u GOROOT PATH="$newpath" "$@"
