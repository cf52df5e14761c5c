#!/usr/bin/env bash
# Mutation pass over the engine's core files in gocore with gremlins
# (github.com/go-gremlins/gremlins), one mutant at a time against
# `go test ./gocore`.
#
#   go install github.com/go-gremlins/gremlins/cmd/gremlins@v0.6.0
#   bash tools/mutate-gocore.sh [out.json] [file.go ...]
#
# With no files it mutates alloc, cache, check, events, free, freelist, pool
# and round (542 mutants before round.go took the rounding out of block.go
# and pool.go); name files (e.g. `free.go freelist.go`) to run a part.
# About 6-10 s a mutant on 2 busy cores (all: about 65 min). gremlins works
# on a copy of the module in a temporary directory; LIVED lines in the
# output are the survivors, TIMED OUT lines mutants that made the tests
# hang (caught). Results: benchmarks/results/mutation.md.
#
# Why the flags:
#   - no --test-cpu: gremlins v0.6.0 passes it to `go test` as the single
#     argument "-cpu N", which go reads as a package that does not exist, so
#     every mutant "fails" with exit status 1 and is reported KILLED without
#     a test having run.
#   - -vet=off: vet is not a test; it only makes each mutant slower (and
#     would count a vet complaint as a kill).
#   - -skip: the slow test that exercises no mutated file (the live index
#     against a map; the sim's latency tests left with gocore/sim).
#   - -count=1: gremlins times the coverage run and gives each mutant that
#     long (times --timeout-coefficient); a coverage run answered from the
#     test cache takes 2 s and every mutant then "times out" while it builds.
#   - --timeout-coefficient 1: the coverage run (which also builds
#     everything) already takes several times one mutant's run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gremlins-gocore.json}
shift || true
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
	files=(alloc.go cache.go check.go events.go free.go freelist.go pool.go round.go)
fi
GREMLINS=${GREMLINS:-$(go env GOPATH)/bin/gremlins}
export GOFLAGS="${GOFLAGS:-} -count=1 -vet=off -skip=TestLiveIndexAgainstAMap"
# Exclude every non-test gocore file not named.
excludes=()
for f in gocore/*.go; do
	base=${f#gocore/}
	case $base in *_test.go) continue ;; esac
	keep=0
	for want in "${files[@]}"; do
		[ "$base" = "$want" ] && keep=1
	done
	[ $keep -eq 1 ] || excludes+=(-E "(^|/)${base//./\\.}\$")
done
exec nice -n 15 "$GREMLINS" unleash --workers 1 --timeout-coefficient 1 \
	"${excludes[@]}" -E 'cuda/' -E 'nccl/' -E 'callback/' -E 'nvmldev/' -E 'internal/' \
	-E 'graphpool/' -E 'options/' -E '(^|/)sim/' -E 'simtest/' \
	-o "$out" ./gocore
