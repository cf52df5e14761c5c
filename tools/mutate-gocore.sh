#!/usr/bin/env bash
# Mutation pass over the engine's core files (gocore: alloc, cache, events,
# free; add more by narrowing EXCLUDE) with gremlins
# (github.com/go-gremlins/gremlins), one mutant at a time against
# `go test ./gocore`.
#
#   go install github.com/go-gremlins/gremlins/cmd/gremlins@v0.6.0
#   bash tools/mutate-gocore.sh [out.json]
#
# About 15-20 s a mutant on 2 cores (~300 mutants for the four files): run
# it on a spare copy of the tree, e.g. `git worktree add /tmp/mut`, as
# gremlins edits the files it mutates. The slow tests that exercise no
# mutated file (the live index against a map, the sim's latency) are
# skipped. LIVED lines in the output are the survivors.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/gremlins-gocore.json}
GREMLINS=${GREMLINS:-$(go env GOPATH)/bin/gremlins}
export GOFLAGS="${GOFLAGS:-} -skip=TestLiveIndexAgainstAMap|TestSimLatency"
EXCLUDE='(^|/)(block|budget|check|errors|history|liveindex|pool|sim|snapshot|stats|backend|freelist)\.go$'
exec "$GREMLINS" unleash --workers 1 --test-cpu 2 --timeout-coefficient 3 \
	-E "$EXCLUDE" -E 'cuda/' -E 'nccl/' -E 'callback/' -E 'nvmldev/' -E 'internal/' \
	-o "$out" ./gocore
