package gocore

import (
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestStatSwapIsDownThenUp: swap(out, in) leaves the counts a down(out)
// followed by an up(in) leaves, the peak included, whichever of out and in
// is larger; StatArray.swap touches the aggregate and its own kind only.
func TestStatSwapIsDownThenUp(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for i := range 10_000 {
		cur := r.Int64N(1000)
		start := Stat{Current: cur, Peak: cur + r.Int64N(3)*r.Int64N(500), Allocated: cur + r.Int64N(100)}
		start.Freed = start.Allocated - cur
		out := r.Int64N(cur + 1)
		in := r.Int64N(2 * (cur + 1)) // above and below out, and past the peak
		if i%7 == 0 {
			in = 0
		}
		want, got := start, start
		want.down(out)
		want.up(in)
		got.swap(out, in)
		require.Equal(t, want, got, "%+v swap(%d, %d)", start, out, in)
	}
	for _, k := range []poolKind{kindSmall, kindLarge} {
		var want, got StatArray
		for i := range want {
			want[i] = Stat{Current: 10, Peak: 12, Allocated: 30, Freed: 20}
		}
		got = want
		want.down(k, 3)
		want.up(k, 8)
		got.swap(k, 3, 8)
		require.Equal(t, want, got, "kind %d", k)
		require.Equal(t, int64(12), got[3-k].Peak, "the other kind is untouched")
		require.Equal(t, int64(15), got[k].Peak)
	}
}
